"""Keyword search in PostgreSQL's full-text search: the PostgreSQL side of fulltext.py.

Each term is its own plainto_tsquery, so no term is ever read as tsquery syntax; a strict search
joins them with && (every term), a relaxed one with || (any). The GIN indexes lead with the
owner, so a search of a reach's users reads their postings only. A relaxed search whose terms
hold more than keywords.POSTING_BUDGET of those postings ranks them among the newest rows that
hold them, and its rarest terms (those within the budget) among all rows, as fulltext.py does.
Rows are ranked by ts_rank_cd (higher is better) and counted for the terms they hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from services.store import keywords
from services.store.keywords import finding_terms, matched_terms, stem
from services.store.model import MemoryRow, Reach
from services.store.pg.db import Database
from services.store.repo import _M_COLUMNS, _filters, _row, _where


@dataclass(frozen=True)
class TextIndex:
    """A tsvector column, the table that holds it, and how that reaches the memories table."""

    table: str
    """The table and its alias (the one the GIN index is on)."""
    join: str
    """FROM-clause tail joining that table to the memories table `m`."""
    terms: str
    """The tsvector column."""
    text: str
    """The indexed text."""
    rowid: str
    """The table's key: higher is newer."""
    owner: str
    """The table's user_id column (the GIN index's first)."""
    only: tuple[str, ...] = ()
    """The condition of a partial GIN index (written out, so the planner may use it)."""


OWN_TEXT = TextIndex("memories m", "", "m.content_terms", "m.content", "m.seq", "m.user_id")
CONTEXT_KEYS = TextIndex(
    "memory_keys mk",
    "JOIN memories m ON m.id = mk.memory_id",
    "mk.text_terms",
    "mk.text",
    "mk.key",
    "mk.user_id",
    ("mk.kind = 'context'",),
)

# The indexes by the names rows.Rows.text_search takes.
BY_NAME = {"own": OWN_TEXT, "context": CONTEXT_KEYS}


@dataclass(frozen=True)
class _Query:
    terms: tuple[str, ...]
    """The terms that find candidate rows."""
    every: bool = False
    """Whether a row must hold all of them (else any)."""
    since: int | None = None
    """Only rowids from this one on (the newest postings), when the budget ran out."""


def _tsquery(query: _Query) -> tuple[str, list[str]]:
    """The tsquery of a query's terms, and its parameters (a stop word's part is empty, and
    && or || with an empty tsquery gives the other side)."""
    one = "plainto_tsquery('english', ?)"
    return "(" + (" && " if query.every else " || ").join([one] * len(query.terms)) + ")", list(
        query.terms
    )


def _owned(index: TextIndex, reach: Reach) -> tuple[list[str], list[Any]]:
    """Conditions on the index's own table that its GIN index answers: the partial index's and
    the reach's users."""
    where = list(index.only)
    if reach.user_ids is None:
        return where, []
    return [*where, f"{index.owner} = ANY(?::text[])"], [list(reach.user_ids)]


async def search(
    db: Database,
    index: str,
    terms: Sequence[str],
    least: int,
    reach: Reach,
    layers: Sequence[str],
    include_superseded: bool,
    k: int,
) -> list[tuple[MemoryRow, float, int]]:
    """Rows holding at least `least` of the terms, best rank first: (row, score, terms held)."""
    text_index = BY_NAME[index]
    owned = _owned(text_index, reach)
    queries = await _plan(db, text_index, owned, terms, least)
    # Every row is ranked by all the terms, whichever of them found it.
    rank = _Query(tuple(terms), every=least >= len(terms))
    term_stems = [stem(t) for t in terms]
    # A few more than k: rows holding too few terms (a stop word, a stem) are dropped after.
    limit = k + k // 4 + 8
    while True:
        ranked, more = await _ranked(
            db, text_index, queries, rank, owned, _filters(reach, layers, include_superseded), limit
        )
        found = []
        for row, text, score in ranked:
            held = max(1, matched_terms(term_stems, text))
            if held >= least:
                found.append((row, score, held))
        if len(found) >= k or not more:
            return found[:k]
        limit *= 4


async def _plan(
    db: Database,
    index: TextIndex,
    owned: tuple[list[str], list[Any]],
    terms: Sequence[str],
    least: int,
) -> list[_Query]:
    """The queries that find a search's candidates (each ranked by all the terms after)."""
    if least >= len(terms):
        return [_Query(tuple(terms), every=True)]
    budget = keywords.POSTING_BUDGET
    postings = await _counts(db, index, owned, terms)
    chosen = finding_terms(postings, least, budget)
    some = _Query(tuple(terms[i] for i in chosen))
    if sum(postings[i] for i in chosen) <= budget:
        return [some]
    # Too many postings: all the terms among the newest rows, and the rarest terms (those
    # that fit the budget) among all rows, so an old row holding a rare term is still found.
    newest = replace(some, since=await _newest_from(db, index, owned, some, budget))
    rare = finding_terms(postings, 1, budget, rarest=False)
    if not rare:
        return [newest]
    return [newest, _Query(tuple(terms[i] for i in rare))]


async def _counts(
    db: Database, index: TextIndex, owned: tuple[list[str], list[Any]], terms: Sequence[str]
) -> list[int]:
    """How many of the owner's rows hold each term, in one statement."""
    where, params = owned
    holds = f"{index.terms} @@ plainto_tsquery('english', ?)"
    one = f"(SELECT count(*) FROM {index.table} {_where([*where, holds])})"
    row = (
        await db.fetch(
            f"SELECT {', '.join([one] * len(terms))}",
            *[p for term in terms for p in (*params, term)],
        )
    )[0]
    return [int(n) for n in row]


async def _newest_from(
    db: Database,
    index: TextIndex,
    owned: tuple[list[str], list[Any]],
    query: _Query,
    budget: int,
) -> int | None:
    """The rowid from which on the newest `budget` rows the query finds lie."""
    where, params = owned
    tsquery, terms = _tsquery(query)
    return await db.fetchval(
        f"SELECT {index.rowid} FROM {index.table} "
        f"{_where([*where, f'{index.terms} @@ {tsquery}'])} "
        f"ORDER BY {index.rowid} DESC LIMIT 1 OFFSET ?",
        *params, *terms, budget - 1,
    )


async def _ranked(
    db: Database,
    index: TextIndex,
    queries: Sequence[_Query],
    rank: _Query,
    owned: tuple[list[str], list[Any]],
    filters: tuple[list[str], list[Any]],
    limit: int,
) -> tuple[list[tuple[MemoryRow, str, float]], bool]:
    """Up to limit rows the queries find inside the filters, best rank (by the rank query)
    first, each with its indexed text, and whether a query may have more."""
    best: dict[int, tuple[MemoryRow, str, float]] = {}
    more = False
    ranking, rank_terms = _tsquery(rank)
    for query in queries:
        tsquery, terms = _tsquery(query)
        window = [] if query.since is None else [query.since]
        where = [
            *owned[0],
            f"{index.terms} @@ {tsquery}",
            *[f"{index.rowid} >= ?" for _ in window],
            *filters[0],
        ]
        rows = await db.fetch(
            # Normalization 1: a long text's rank is divided by the log of its length.
            f"SELECT {_M_COLUMNS}, {index.text}, {index.rowid}, "
            f"ts_rank_cd({index.terms}, {ranking}, 1) AS score "
            f"FROM {index.table} {index.join} {_where(where)} ORDER BY score DESC LIMIT ?",
            *rank_terms, *owned[1], *terms, *window, *filters[1], limit,
        )
        more = more or len(rows) == limit
        for r in rows:
            rowid, score = int(r[28]), float(r[29])
            best[rowid] = (_row(r), str(r[27]), score)
    ranked = sorted(best.values(), key=lambda hit: hit[2], reverse=True)
    return ranked[:limit], more
