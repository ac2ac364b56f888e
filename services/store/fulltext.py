"""Keyword search over the FTS5 indexes: one owner's postings, a bounded amount of them.

A search of a user who holds a small share of the rows matches the owner key as well as the
terms, so it reads that user's postings only. A relaxed search (fewer terms than all) whose
terms hold more than keywords.POSTING_BUDGET postings ranks all of them among the newest rows
that hold them, and its rarest terms (those within the budget) among all rows. Rows are then
read, filtered, and counted for the terms they hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.store import keywords
from services.store.keywords import finding_terms, matched_terms, stem
from services.store.model import MemoryRow, Reach

if TYPE_CHECKING:
    from services.store.repo import Repo


@dataclass(frozen=True)
class TextIndex:
    """One FTS5 table, its text column, and how its rowids reach the memories table."""

    name: str
    """How rows.Rows.text_search names it; each index is read on a connection of its own."""
    table: str
    column: str
    join: str
    """FROM-clause tail joining json_each `j` (the rowids) to the memories table `m`."""
    text: str
    """The SQL expression of the indexed text."""


OWN_TEXT = TextIndex(
    "own",
    "memories_fts", "content", "CROSS JOIN memories m ON m.seq = j.value", "m.content"
)
CONTEXT_KEYS = TextIndex(
    "context",
    "memory_keys_fts",
    "text",
    "CROSS JOIN memory_keys mk ON mk.key = j.value CROSS JOIN memories m ON m.id = mk.memory_id",
    "mk.text",
)


# The indexes by the names rows.Rows.text_search takes.
BY_NAME = {index.name: index for index in (OWN_TEXT, CONTEXT_KEYS)}


class OwnerShares:
    """What share of the rows each user holds: below SMALL, matching their owner key narrows
    a search; for a user who holds most rows it only costs (their rows are filtered after).

    Counts are cached and counted again once the table has grown by a tenth: the share only
    picks a strategy, so a stale one is harmless.
    """

    SMALL = 0.6
    CACHED = 10_000

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], tuple[int, int]] = {}

    async def share(self, repo: Repo, user_id: str) -> float:
        """About what share of the rows the user holds."""
        total = await repo.row_seq_high()
        key = (str(repo.db_path), user_id)
        cached = self._rows.get(key)
        if cached is None or total > cached[1] * 1.1 + 100:
            if len(self._rows) >= self.CACHED:
                self._rows.clear()
            cached = self._rows[key] = (await repo.user_row_count(user_id), total)
        return min(1.0, cached[0] / max(total, 1))


SHARES = OwnerShares()


@dataclass(frozen=True)
class _Query:
    match: str
    """The MATCH expression that finds candidate rows."""
    since: int | None = None
    """Only rowids from this one on (the newest postings), when the budget ran out."""


@dataclass(frozen=True)
class _Plan:
    queries: tuple[_Query, ...]
    """Each finds candidates; a row's best score among them ranks it."""
    exact: bool
    """Whether every row found holds all the terms."""
    kept: float = 1.0
    """About what share of the rows found belong to the owner (rows are filtered after)."""


def owner_token(user_id: str) -> str:
    """The owner key a user's rows are indexed under (schema.py computes the same in SQL)."""
    return "o" + user_id.encode().hex().upper()


def _phrase(term: str) -> str:
    # A double-quoted FTS5 string is a phrase: its content is never parsed as query syntax.
    return '"' + term.replace('"', '""') + '"'


async def search(
    repo: Repo,
    index: TextIndex,
    terms: Sequence[str],
    least: int,
    reach: Reach,
    layers: Sequence[str],
    include_superseded: bool,
    k: int,
) -> list[tuple[MemoryRow, float, int]]:
    """Rows holding at least `least` of the terms, best bm25 first: (row, score, terms held)."""
    plan = await _plan(repo, index, terms, least, reach)
    term_stems = [stem(t) for t in terms]
    # A few more than k: filters (agent, layer, status, another owner) usually drop a few.
    limit = math.ceil((k + k // 4 + 8) / plan.kept)
    while True:
        ranked, more = await _ranked(repo, index, plan, limit)
        rows = await repo.rows_at_text_hits(
            index,
            [rowid for rowid, _ in ranked],
            reach,
            layers,
            include_superseded,
        )
        found = []
        for rowid, score in ranked:
            if rowid not in rows:
                continue
            row, text = rows[rowid]
            held = len(terms) if plan.exact else max(1, matched_terms(term_stems, text))
            if held >= least:
                found.append((row, -score, held))
            if len(found) == k:
                return found
        if not more:
            return found
        limit *= 4


async def _plan(
    repo: Repo, index: TextIndex, terms: Sequence[str], least: int, reach: Reach
) -> _Plan:
    phrases = [f"{index.column} : {_phrase(t)}" for t in terms]
    owner = ""
    one = reach.user_ids[0] if reach.user_ids is not None and len(reach.user_ids) == 1 else None
    share = 1.0 if one is None else await SHARES.share(repo, one)
    if one is not None and share < SHARES.SMALL:
        owner = f'owner_key : "{owner_token(one)}" AND '
    kept = 1.0 if owner or one is None else max(share, 0.05)
    if least >= len(terms):
        return _Plan((_Query(owner + " AND ".join(phrases)),), exact=True, kept=kept)
    postings = await _counts(repo, index, [f"{owner}{p}" for p in phrases])
    chosen = finding_terms(postings, least, keywords.POSTING_BUDGET)
    match = f"{owner}({' OR '.join(phrases[i] for i in chosen)})"
    if sum(postings[i] for i in chosen) <= keywords.POSTING_BUDGET:
        return _Plan((_Query(match),), exact=False, kept=kept)
    # Too many postings: all the terms among the newest rows, and the rarest terms (those
    # that fit the budget) among all rows, so an old row holding a rare term is still found.
    newest = _Query(match, await _newest_from(repo, index, match))
    rare = finding_terms(postings, 1, keywords.POSTING_BUDGET, rarest=False)
    if not rare:
        return _Plan((newest,), exact=False, kept=kept)
    everywhere = _Query(f"{owner}({' OR '.join(phrases[i] for i in rare)})")
    return _Plan((newest, everywhere), exact=False, kept=kept)


async def _counts(repo: Repo, index: TextIndex, matches: Sequence[str]) -> list[int]:
    """How many rows each expression finds, up to one past the posting budget, in one
    statement: finding_terms decides the same for any count past the budget, and counting
    stops there instead of reading a common term's every posting (on a bare FTS5 table of
    100,000 bench texts, one index's counts for a search went from 5.3 to 1.3 ms)."""
    one = (
        f"(SELECT count(*) FROM (SELECT 1 FROM {index.table} WHERE {index.table} MATCH ? "
        "LIMIT ?))"
    )
    past_budget = keywords.POSTING_BUDGET + 1
    rows = await repo.text_reader(index.name).execute_fetchall(
        f"SELECT {', '.join([one] * len(matches))}",
        tuple(value for match in matches for value in (match, past_budget)),
    )
    return [int(n) for n in next(iter(rows))]


async def _newest_from(repo: Repo, index: TextIndex, match: str) -> int | None:
    """The rowid from which on the newest POSTING_BUDGET rows the expression finds lie."""
    rows = await repo.text_reader(index.name).execute_fetchall(
        f"SELECT rowid FROM {index.table} WHERE {index.table} MATCH ? "
        "ORDER BY rowid DESC LIMIT 1 OFFSET ?",
        (match, keywords.POSTING_BUDGET - 1),
    )
    return next((int(r[0]) for r in rows), None)


async def _ranked(
    repo: Repo, index: TextIndex, plan: _Plan, limit: int
) -> tuple[list[tuple[int, float]], bool]:
    """Up to limit rowids the plan finds, best bm25 first (lower is better, as FTS5 gives it),
    and whether a query may have more."""
    best: dict[int, float] = {}
    more = False
    for query in plan.queries:
        window = "" if query.since is None else "AND rowid >= ?"
        params = (query.match,) if query.since is None else (query.match, query.since)
        rows = list(
            await repo.text_reader(index.name).execute_fetchall(
                # The owner key column weighs nothing: only the text's terms rank.
                f"SELECT rowid, bm25({index.table}, 1.0, 0.0) AS score FROM {index.table} "
                f"WHERE {index.table} MATCH ? {window} ORDER BY score LIMIT ?",
                (*params, limit),
            )
        )
        more = more or len(rows) == limit
        for rowid, score in rows:
            best[int(rowid)] = min(float(score), best.get(int(rowid), float("inf")))
    return sorted(best.items(), key=lambda item: item[1])[:limit], more
