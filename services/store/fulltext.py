"""Keyword search over the keyword indexes: one owner's postings, a bounded amount of them.

A search of a user who holds a small share of the rows matches the owner key as well as the
terms, so it reads that user's postings only. A relaxed search (fewer terms than all) whose
terms hold more than keywords.POSTING_BUDGET postings ranks all of them among about the newest
rows that hold that many, and its rarest terms (those within the budget) among all rows. Rows
are then read, filtered, and counted for the terms they hold.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import tantivy

from services.store import keywords
from services.store.keywords import finding_terms, matched_terms, stem
from services.store.model import FEW_PASSING, MemoryRow, Reach
from services.store.text_index import KeywordIndex

if TYPE_CHECKING:
    from services.store.repo import Repo


@dataclass(frozen=True)
class TextIndex:
    """One keyword index and how its ids reach the memories table."""

    name: str
    """How rows.Rows.text_search names it; each index is read on a connection of its own."""
    join: str
    """FROM-clause tail joining json_each `j` (the ids) to the memories table `m`."""
    text: str
    """The SQL expression of the indexed text."""
    ids: str
    """The FROM clause of the indexed ids (`id`) of the memories table's rows `m`."""


OWN_TEXT = TextIndex(
    "own", "CROSS JOIN memories m ON m.seq = j.value", "m.content", "m.seq AS id FROM memories m"
)
CONTEXT_KEYS = TextIndex(
    "context",
    "CROSS JOIN memory_keys mk ON mk.key = j.value CROSS JOIN memories m ON m.id = mk.memory_id",
    "mk.text",
    "mk.key AS id FROM memories m "
    "JOIN memory_keys mk ON mk.memory_id = m.id AND mk.kind = 'context'",
)


# The indexes by the names rows.Rows.text_search takes.
BY_NAME = {index.name: index for index in (OWN_TEXT, CONTEXT_KEYS)}


class OwnerShares:
    """How many rows each user holds, and what share of all rows that is: below SMALL,
    matching their owner key narrows a search; for a user who holds most rows it only costs
    (their rows are filtered after).

    Counts are cached and counted again once the table has grown by a tenth: the share only
    picks a strategy and the count weighs terms (on a log scale), so a stale one is harmless.
    """

    SMALL = 0.6
    CACHED = 10_000

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], tuple[int, int]] = {}

    async def counts(self, repo: Repo, user_id: str) -> tuple[int, int]:
        """About how many rows the user holds, and how many rows there are."""
        total = await repo.row_seq_high()
        key = (str(repo.db_path), user_id)
        cached = self._rows.get(key)
        if cached is None or total > cached[1] * 1.1 + 100:
            if len(self._rows) >= self.CACHED:
                self._rows.clear()
            cached = self._rows[key] = (await repo.user_row_count(user_id), total)
        return cached[0], max(total, 1)


SHARES = OwnerShares()


def owner_token(user_id: str) -> str:
    """The owner key a user's rows are indexed under (schema.py computes the same in SQL)."""
    return "o" + user_id.encode().hex().upper()


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
    """Rows holding at least `least` of the terms, best score first: (row, score, terms held)."""
    keyword = await repo.keyword_index(index.name)
    if not keyword.built:
        return []
    few = None
    if layers:
        few = await repo.text_ids_within(index, reach, layers, include_superseded, FEW_PASSING)
    owner = await _owner(repo, reach)
    # A few more than k: filters (agent, layer, status, another owner) usually drop a few.
    limit = math.ceil((k + k // 4 + 8) / owner.found_share)
    term_stems = [stem(t) for t in terms]
    while True:
        finder = _Finder(keyword, owner, few)
        found_ids = await asyncio.to_thread(finder.find, terms, least, limit)
        kept = _Kept(terms, term_stems, least, found_ids.exact)
        found = await kept.rows(repo, index, found_ids.ranked, reach, layers, include_superseded, k)
        if len(found) == k or not found_ids.more:
            return found
        limit *= 4


@dataclass(frozen=True)
class _Kept:
    """Which rows found a search keeps: those holding `least` of its terms."""

    terms: Sequence[str]
    term_stems: Sequence[str]
    least: int
    exact: bool
    """Whether every row found holds all the terms."""

    async def rows(
        self,
        repo: Repo,
        index: TextIndex,
        ranked: Sequence[tuple[int, float]],
        reach: Reach,
        layers: Sequence[str],
        include_superseded: bool,
        k: int,
    ) -> list[tuple[MemoryRow, float, int]]:
        """The best k rows kept (row, score, terms held), read a slice at a time: the rows
        still missing (most searches need no more), or as many as read so far when filters
        drop most."""
        found: list[tuple[MemoryRow, float, int]] = []
        read = 0
        while len(found) < k and read < len(ranked):
            step = ranked[read : read + max(k - len(found), read)]
            read += len(step)
            rows = await repo.rows_at_text_hits(
                index, [row_id for row_id, _ in step], reach, layers, include_superseded
            )
            for row_id, score in step:
                if row_id in rows and len(found) < k:
                    row, text = rows[row_id]
                    held = self._held(text)
                    if held >= self.least:
                        found.append((row, score, held))
        return found

    def _held(self, text: str) -> int:
        if self.exact:
            return len(self.terms)
        return max(1, matched_terms(self.term_stems, text))


@dataclass(frozen=True)
class _Owner:
    """Whose rows a search reads."""

    key: str | None
    """The owner key to match, if matching it narrows the search."""
    found_share: float
    """About what share of the rows found will be the owner's."""
    rows: int | None
    """How many rows the owner holds, when the key is matched (the terms' postings are then
    the owner's; else they are all rows')."""


async def _owner(repo: Repo, reach: Reach) -> _Owner:
    one = reach.user_ids[0] if reach.user_ids is not None and len(reach.user_ids) == 1 else None
    if one is None:
        return _Owner(None, 1.0, None)
    rows, total = await SHARES.counts(repo, one)
    if rows / total < SHARES.SMALL:
        return _Owner(owner_token(one), 1.0, rows)
    return _Owner(None, max(rows / total, 0.05), None)


@dataclass(frozen=True)
class _Found:
    ranked: list[tuple[int, float]]
    """Ids, best score first (higher is better)."""
    more: bool
    """Whether a query may have found more."""
    exact: bool
    """Whether every row found holds all the terms."""


# What a term's bm25 adds to its idf in a relaxed search's score (see _Finder._weighed).
TIE_BREAK = 0.05


def _int(value: float | None) -> int:
    if value is None:  # a segment without the field: never written by this store
        raise RuntimeError("a keyword index document has no id")
    return int(value)


def _filter(query: tantivy.Query) -> tantivy.Query:
    """A query that only decides which rows count: it adds nothing to their score."""
    return tantivy.Query.const_score_query(query, 0.0)


class _Finder:
    """The queries of one search on one index, run on its current searcher (in a thread)."""

    def __init__(
        self, keyword: KeywordIndex, owner: _Owner, among: Sequence[int] | None = None
    ) -> None:
        self.schema = keyword.schema
        self.keyword = keyword
        self.searcher = keyword.index.searcher()
        self.owner = None if owner.key is None else _filter(
            tantivy.Query.term_query(self.schema, "owner", owner.key, index_option="basic")
        )
        # How many rows the terms' postings are counted among.
        self.rows = self.searcher.num_docs if owner.rows is None else owner.rows
        # The ids of the only rows that may be found, when few rows pass the search's filters.
        self.among = None if among is None else list(among)

    def _term(self, field: str, value: str) -> tantivy.Query:
        return tantivy.Query.term_query(self.schema, field, value, index_option="freq")

    def _all(self, *queries: tantivy.Query | None) -> tantivy.Query:
        must = tantivy.Occur.Must
        return tantivy.Query.boolean_query([(must, q) for q in queries if q is not None])

    def _any(self, queries: Sequence[tantivy.Query], least: int | None = None) -> tantivy.Query:
        """Rows holding one of the queries' terms (or `least` of them)."""
        should = tantivy.Occur.Should
        return tantivy.Query.boolean_query([(should, q) for q in queries], least)

    def _at_least(self, queries: Sequence[tantivy.Query], least: int) -> tantivy.Query | None:
        """Rows holding `least` of the terms, as a filter (the finding terms give the score);
        None when any term will do.

        Without it, a strict search of many terms read rows holding only the rare ones until
        it had k that held enough: 50-110 ms at 100,000 memories of one owner.
        """
        return None if least <= 1 else _filter(self._any(queries, least))

    def find(self, words: Sequence[str], least: int, limit: int) -> _Found:
        terms = self.keyword.terms(words)
        found = [None if t is None else self._term("text", t) for t in terms]
        strict = least >= len(words)
        postings = [0 if t is None or strict else self._postings(t) for t in terms]
        if not strict:
            found = [self._weighed(q, n) for q, n in zip(found, postings, strict=True)]
        if self.among is not None:
            return self._among_few(found, least, limit)
        if strict:
            if any(q is None for q in found):
                return _Found([], False, True)
            return self._ranked([self._all(self.owner, *found)], limit, exact=True)
        chosen = [i for i in finding_terms(postings, least, keywords.POSTING_BUDGET) if found[i]]
        known = [q for q in found if q is not None]
        if not chosen or len(known) < least:
            return _Found([], False, False)
        at_least = self._at_least(known, least)
        match = self._all(self.owner, self._any([q for i in chosen if (q := found[i])]), at_least)
        read = sum(postings[i] for i in chosen)
        if read <= keywords.POSTING_BUDGET:
            return self._ranked([match], limit, exact=False)
        # Too many postings: all the terms among the newest rows, and the rarest terms (those
        # that fit the budget) among all rows, so an old row holding a rare term is still found.
        queries = [self._newest(match, read)]
        rare = finding_terms(postings, 1, keywords.POSTING_BUDGET, rarest=False)
        rare_found = [q for i in rare if (q := found[i])]
        if rare_found:
            queries.append(self._all(self.owner, self._any(rare_found), at_least))
        return self._ranked(queries, limit, exact=False)

    def _among_few(self, found: list[tantivy.Query | None], least: int, limit: int) -> _Found:
        """The search among the few rows `among` names: every term finds them, no budget."""
        known = [q for q in found if q is not None]
        if not self.among or len(known) < least:
            return _Found([], False, least >= len(found))
        only = _filter(tantivy.Query.term_set_query(self.schema, "id", self.among))
        if least >= len(found):
            return self._ranked([self._all(only, *known)], limit, exact=True)
        match = self._all(only, self._any(known), self._at_least(known, least))
        return self._ranked([match], limit, exact=False)

    def _weighed(self, term: tantivy.Query | None, postings: int) -> tantivy.Query | None:
        """A relaxed search's query of one term, scored by the term's idf among the rows
        searched plus a twentieth of its bm25.

        A row's score adds those of the terms it holds, so a row holding rarer terms ranks
        above one holding a common term often or in a short text (bm25 alone ranked those
        above, on LoCoMo's turns: recall_any@10 0.837 -> 0.851, as PostgreSQL's ranking does);
        bm25 orders the rows holding the same terms.
        """
        if term is None:
            return None
        weight = tantivy.Query.const_score_query(term, keywords.idf(self.rows, postings))
        tie_break = tantivy.Query.boost_query(term, TIE_BREAK)
        return self._any([weight, tie_break])

    def _postings(self, term: str) -> int:
        """How many rows hold a term: the owner's when the owner is matched (counted up to
        one past the posting budget, and past it estimated from the term's share of all rows:
        finding_terms decides the same for any count past it); else all of them (deleted rows
        too, until their segment is merged)."""
        if self.owner is None:
            return int(self.searcher.doc_freq("text", term))
        query = self._all(self.owner, self._term("text", term))
        held = len(self.searcher.search(query, keywords.POSTING_BUDGET + 1, count=False).hits)
        if held <= keywords.POSTING_BUDGET:
            return held
        share = self.searcher.doc_freq("text", term) / max(self.searcher.num_docs, 1)
        return max(held, round(share * self.rows))

    def _newest(self, match: tantivy.Query, postings: int) -> tantivy.Query:
        """The match among about the newest POSTING_BUDGET rows it finds.

        Without an owner filter the postings are all rows' and the window is the newest
        POSTING_BUDGET / postings of the ids, as if the terms were spread evenly over time (no
        read at all: finding the exact window means visiting every row that matches). The
        owner's window is found exactly: the rows visited are only the owner's.
        """
        if self.owner is None:
            since = self.keyword.newest_ids(keywords.POSTING_BUDGET / postings)
        else:
            hits = self.searcher.search(
                match,
                1,
                count=False,
                offset=keywords.POSTING_BUDGET - 1,
                order_by_field="id",
                order=tantivy.Order.Desc,
            ).hits
            if not hits:
                return match
            since = _int(self.searcher.fast_field_values("id", [hits[0][1]])[0])
        window = tantivy.Query.range_query(
            self.schema, "id", tantivy.FieldType.Integer, since, None
        )
        return self._all(match, _filter(window))

    def _ranked(self, queries: Sequence[tantivy.Query], limit: int, exact: bool) -> _Found:
        best: dict[int, float] = {}
        more = False
        for query in queries:
            hits = self.searcher.search(query, limit, count=False).hits
            more = more or len(hits) == limit
            ids = self.searcher.fast_field_values("id", [address for _, address in hits])
            for (score, _), value in zip(hits, ids, strict=True):
                row_id = _int(value)
                best[row_id] = max(float(score), best.get(row_id, float(score)))
        ranked = sorted(best.items(), key=lambda item: -item[1])[:limit]
        return _Found(ranked, more, exact)
