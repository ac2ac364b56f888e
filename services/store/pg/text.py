"""Keyword search in PostgreSQL's full-text search: the PostgreSQL side of fulltext.py.

Each term is its own plainto_tsquery, so no term is ever read as tsquery syntax; a strict search
joins them with && (every term), a relaxed one with || (any). The GIN indexes lead with the
owner, so a search of a reach's users reads their postings only. A relaxed search whose terms
hold more than keywords.POSTING_BUDGET of those postings ranks them among the newest rows that
hold them, and its rarest terms (those within the budget) among all rows, as fulltext.py does.
Rows are ranked by ts_rank_cd (higher is better), a relaxed search's with each term's idf
added for the terms a row holds, and counted for the terms they hold.

What keeps it fast: ts_rank_cd costs several times what ts_rank does per row, so each query
ranks its rows by ts_rank on the index's table alone and only the best few by ts_rank_cd, joined
to their memories after; a term's postings are counted only as far as the budget and cached
(Postings); and a search's statements are planned for their terms (_reading).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import asyncpg

from services.store import keywords
from services.store.keywords import finding_terms, matched_terms, stem
from services.store.model import MemoryRow, Reach
from services.store.pg.db import Database, checked, numbered
from services.store.pg.schema import TEXT_CONFIG
from services.store.repo import _M_COLUMNS, ROW_WIDTH, _filters, _row, _where


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

# Each query ranks this many times its limit of rows (the best by ts_rank) by ts_rank_cd.
CHEAP_SHARE = 2

TERM = f"plainto_tsquery('{TEXT_CONFIG}', ?)"
"""One query term as a tsquery, made as the keyword columns make their terms."""

# The indexes by the names rows.Rows.text_search takes.
BY_NAME = {"own": OWN_TEXT, "context": CONTEXT_KEYS}


@dataclass(frozen=True)
class _Query:
    terms: tuple[str, ...]
    """The terms that find candidate rows."""
    every: bool = False
    """Whether a row must hold all of them (else any)."""
    newest: int | None = None
    """Only the newest this many rows it finds (the newest postings), when the budget ran out."""
    least: int = 0
    """Only rows holding this many of `held` (more than one: else any row found will do)."""
    held: tuple[str, ...] = ()


def _tsquery(query: _Query) -> tuple[str, list[str]]:
    """The tsquery of a query's terms, and its parameters (a term with no lexeme is empty, and
    && or || with an empty tsquery gives the other side)."""
    joined = (" && " if query.every else " || ").join([TERM] * len(query.terms))
    return f"({joined})", list(query.terms)


@dataclass(frozen=True)
class _Plan:
    queries: tuple[_Query, ...]
    """Each finds candidates; every row found is ranked by all the terms."""
    weights: tuple[float, ...] = ()
    """Each term's idf among the owner's rows (a relaxed search): a row's score adds those of
    the terms it holds, so a rare term counts for more than a common one, as in bm25."""


def _score(
    index: TextIndex, terms: Sequence[str], plan: _Plan, rank: str
) -> tuple[str, list[Any]]:
    """The SQL of a row's score, and its parameters: the rank function (ts_rank or
    ts_rank_cd) by all the terms, joined as the search joins them (a strict search has no
    weights), divided by the log of the text's length (normalization 1); plus the weights of
    the terms the row holds."""
    ranking, ranked_terms = _tsquery(_Query(tuple(terms), every=not plan.weights))
    sql = f"{rank}({index.terms}, {ranking}, 1)"
    params: list[Any] = list(ranked_terms)
    for term, weight in zip(terms, plan.weights, strict=False):
        sql += f" + ({index.terms} @@ {TERM})::int * ?::float8"
        params += [term, weight]
    return sql, params


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
    async with _reading(db) as reader:
        plan = await _plan(reader, text_index, owned, terms, least)
        scores = (
            _score(text_index, terms, plan, "ts_rank"),
            _score(text_index, terms, plan, "ts_rank_cd"),
        )
        filters = _filters(reach, layers, include_superseded)
        term_stems = [stem(t) for t in terms]
        # Rows a strict search finds hold every term (as tantivy's exact matches, whose words
        # may differ from the text's by an accent, which matched_terms does not fold).
        exact = all(query.every for query in plan.queries)
        # A few more than k: rows holding too few terms (a stop word, a stem) are dropped after.
        limit = k + k // 4 + 8
        while True:
            ranked, more = await _ranked(
                reader, text_index, plan.queries, scores, owned, filters, limit
            )
            found = []
            for row, text, row_score in ranked:
                held = len(terms) if exact else max(1, matched_terms(term_stems, text))
                if held >= least:
                    found.append((row, row_score, held))
            if len(found) >= k or not more:
                return found[:k]
            limit *= 4


class _Reader:
    """One connection's reads (with `?` placeholders) inside a search's transaction."""

    def __init__(self, conn: asyncpg.Connection, dsn: str) -> None:
        self.conn = conn
        self.dsn = dsn

    async def fetch(self, sql: str, *params: Any) -> list[asyncpg.Record]:
        """The rows of one read."""
        with checked():
            return await self.conn.fetch(numbered(sql), *params)


@contextlib.asynccontextmanager
async def _reading(db: Database) -> AsyncIterator[_Reader]:
    """A read-only transaction whose statements are planned for their parameters each time,
    and read rows by an index wherever one serves.

    The pool's connections cache their statements, and after a few runs PostgreSQL may plan
    one for any parameters: then plainto_tsquery is no longer folded into a constant but runs
    for every row and every term, which costs more than the search itself. And the planner
    takes a LIMITed read of a common term's rows to be cheapest by a scan of the table (as if
    they were spread evenly), where the GIN index finds them without reading any other row.
    """
    async with db.connection() as conn, conn.transaction(readonly=True):
        await conn.execute(
            "SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL enable_seqscan = off"
        )
        yield _Reader(conn, db.dsn)


async def _plan(
    reader: _Reader,
    index: TextIndex,
    owned: tuple[list[str], list[Any]],
    terms: Sequence[str],
    least: int,
) -> _Plan:
    """The queries that find a search's candidates, and the terms' weights."""
    if least >= len(terms):
        return _Plan((_Query(tuple(terms), every=True),))
    budget = keywords.POSTING_BUDGET
    rows, postings = await POSTINGS.count(reader, index, owned, terms)
    weights = tuple(keywords.idf(rows, n) for n in postings)
    chosen = finding_terms(postings, least, budget)
    held = _holding(terms, postings, least)
    some = replace(held, terms=tuple(terms[i] for i in chosen))
    if sum(postings[i] for i in chosen) <= budget:
        return _Plan((some,), weights)
    # Too many postings: all the terms among the newest rows, and the rarest terms (those
    # that fit the budget) among all rows, so an old row holding a rare term is still found.
    newest = replace(some, newest=budget)
    rare = finding_terms(postings, 1, budget, rarest=False)
    if not rare:
        return _Plan((newest,), weights)
    return _Plan((newest, replace(held, terms=tuple(terms[i] for i in rare))), weights)


def _holding(terms: Sequence[str], postings: Sequence[int], least: int) -> _Query:
    """A query's condition that its rows hold `least` of the terms, so a search of many terms
    does not read rows holding only its rarest until it has enough that hold more.

    A filter ahead of matched_terms (which decides): a term without postings (none of the
    owner's rows holds it) is taken as held by every row.
    """
    unseen = sum(1 for n in postings if n == 0)
    seen = tuple(term for term, n in zip(terms, postings, strict=True) if n)
    return _Query((), least=least - unseen, held=seen)


class Postings:
    """How many rows of an owner's each term is in (and how many rows the owner has), by
    index, counted once and again when the index's newest rowid has grown by a tenth since.

    Counting visits every posting's row, so a big owner's common term would cost more than the
    search itself. The counts only pick the terms that find rows, which needs them exact up to
    keywords.POSTING_BUDGET, and weigh them (an idf, on a log scale): a term beyond the budget
    is counted among the owner's newest POSTING_BUDGET rows and its share of those taken for
    all, and a slightly stale count is harmless. At most CACHED counts are kept.
    """

    CACHED = 50_000
    GROWTH = 1.1

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, tuple[str, ...] | None, str], tuple[int, int]] = {}

    async def count(
        self,
        reader: _Reader,
        index: TextIndex,
        owned: tuple[list[str], list[Any]],
        terms: Sequence[str],
    ) -> tuple[int, list[int]]:
        """How many rows the owner has in the index, and how many of them hold each term."""
        owner = tuple(owned[1][0]) if owned[1] else None
        keys = {term: (reader.dsn, index.terms, owner, term) for term in ("", *terms)}
        cached = {term: self._counts[key] for term, key in keys.items() if key in self._counts}
        high, counted = await _counted(reader, index, owned, [t for t in keys if t not in cached])
        stale = [t for t, (_, at) in cached.items() if high > at * self.GROWTH]
        if stale:
            high, recounted = await _counted(reader, index, owned, stale)
            counted.update(recounted)
        common = [t for t, n in counted.items() if t and n > keywords.POSTING_BUDGET]
        if common:
            rows = counted[""] if "" in counted else cached[""][0]
            shares = await _newest_shares(reader, index, owned, common)
            for term in common:
                counted[term] = max(counted[term], round(shares[term] * rows))
        if len(self._counts) + len(counted) > self.CACHED:
            self._counts.clear()
        for term, n in counted.items():
            self._counts[keys[term]] = (n, high)
            cached[term] = (n, high)
        return cached[""][0], [cached[term][0] for term in terms]


POSTINGS = Postings()


async def _counted(
    reader: _Reader, index: TextIndex, owned: tuple[list[str], list[Any]], terms: Sequence[str]
) -> tuple[int, dict[str, int]]:
    """The index's newest rowid, and how many of the owner's rows hold each term, up to one
    more than keywords.POSTING_BUDGET (the empty term: how many rows the owner has, all), in
    one statement."""
    sql, values = counting(index, owned, terms)
    row = (await reader.fetch(sql, *values))[0]
    return int(row[0]), {term: int(n) for term, n in zip(terms, row[1:], strict=True)}


def counting(
    index: TextIndex, owned: tuple[list[str], list[Any]], terms: Sequence[str]
) -> tuple[str, list[Any]]:
    """_counted's statement and its parameters. The owner's rows (the empty term) are counted
    from a btree index alone once the table is vacuumed (memories_session_turns,
    memory_keys_context_owner): the GIN index's count reads every row."""
    where, params = owned
    counts: list[str] = []
    values: list[Any] = []
    for term in terms:
        if not term:
            counts.append(f"(SELECT count(*) FROM {index.table} {_where(where)})")
            values += params
            continue
        holds = f"{index.terms} @@ {TERM}"
        counts.append(
            f"(SELECT count(*) FROM (SELECT FROM {index.table} {_where([*where, holds])} "
            "LIMIT ?) AS postings)"
        )
        values += [*params, term, keywords.POSTING_BUDGET + 1]
    sql = f"SELECT (SELECT coalesce(max({index.rowid}), 0) FROM {index.table})" + "".join(
        f", {count}" for count in counts
    )
    return sql, values


async def _newest_shares(
    reader: _Reader, index: TextIndex, owned: tuple[list[str], list[Any]], terms: Sequence[str]
) -> dict[str, float]:
    """What share of the owner's newest keywords.POSTING_BUDGET rows hold each term, in one
    statement."""
    where, params = owned
    holds = f"{index.terms} @@ {TERM}"
    alias = index.table.split()[-1]
    row = (
        await reader.fetch(
            f"SELECT count(*), {', '.join([f'count(*) FILTER (WHERE {holds})'] * len(terms))} "
            f"FROM (SELECT * FROM {index.table} {_where(where)} "
            f"ORDER BY {index.rowid} DESC LIMIT ?) {alias}",
            *terms, *params, keywords.POSTING_BUDGET,
        )
    )[0]
    return {term: int(n) / max(int(row[0]), 1) for term, n in zip(terms, row[1:], strict=True)}


def _found(
    index: TextIndex, query: _Query, owned: tuple[list[str], list[Any]]
) -> tuple[str, list[str], list[Any]]:
    """The FROM clause (under the table's alias) and the conditions of the index's rows a query
    finds, and their parameters in that order: the newest of them only in a subquery that reads
    them newest first and stops there, so they are read once."""
    tsquery, terms = _tsquery(query)
    where = [*owned[0], f"{index.terms} @@ {tsquery}"]
    params = [*owned[1], *terms]
    if query.least > 1:
        holds = f"({index.terms} @@ {TERM})::int"
        where.append(f"{' + '.join([holds] * len(query.held))} >= ?")
        params += [*query.held, query.least]
    if query.newest is None:
        return index.table, where, params
    alias = index.table.split()[-1]
    newest = f"ORDER BY {index.rowid} DESC LIMIT ?"
    return (
        f"(SELECT * FROM {index.table} {_where(where)} {newest}) {alias}",
        [],
        [*params, query.newest],
    )


async def _ranked(
    reader: _Reader,
    index: TextIndex,
    queries: Sequence[_Query],
    scores: tuple[tuple[str, list[Any]], tuple[str, list[Any]]],
    owned: tuple[list[str], list[Any]],
    filters: tuple[list[str], list[Any]],
    limit: int,
) -> tuple[list[tuple[MemoryRow, str, float]], bool]:
    """Up to limit rows the queries find inside the filters, best score first, each with its
    indexed text, and whether a query may have more.

    Each query ranks its rows by the cheap score (ts_rank) on the index's table alone; only the
    best few times limit of them are joined to their memories and ranked by the final score
    (ts_rank_cd), which costs several times as much per row.
    """
    cheap, final = scores
    # The memories table's own conditions can narrow the candidates; a key's only after.
    inside, outside = (filters, ([], [])) if not index.join else (([], []), filters)
    on = [f"{index.rowid} = c.rowid", *outside[0]]
    joined = f"({index.table} {index.join})" if index.join else index.table
    best: dict[int, tuple[MemoryRow, str, float]] = {}
    more = False
    for query in queries:
        source, where, found = _found(index, query, owned)
        # Every candidate comes back, those outside the filters as nulls, so that a query whose
        # best candidates are all filtered out still says it may have more.
        rows = await reader.fetch(
            f"WITH c AS (SELECT {index.rowid} AS rowid FROM {source} "
            f"{_where([*where, *inside[0]])} ORDER BY {cheap[0]} DESC LIMIT ?) "
            f"SELECT {_M_COLUMNS}, {index.text}, {index.rowid}, {final[0]} AS score "
            f"FROM c LEFT JOIN {joined} ON {' AND '.join(on)}",
            *found, *inside[1], *cheap[1], limit * CHEAP_SHARE, *final[1], *outside[1],
        )
        more = more or len(rows) == limit * CHEAP_SHARE
        for r in rows:
            if r[0] is not None:
                best[int(r[ROW_WIDTH + 1])] = (
                    _row(r), str(r[ROW_WIDTH]), float(r[ROW_WIDTH + 2])
                )
    ranked = sorted(best.values(), key=lambda hit: hit[2], reverse=True)
    return ranked[:limit], more
