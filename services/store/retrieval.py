"""Vector search (approximate, with an exact fallback) and keyword search over a reach."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from services.store.core import Core
from services.store.keys import CONTEXT_LAYERS, MOST_CLAUSES_HELD, NEIGHBOUR_GAP_S
from services.store.keywords import query_terms, required_terms
from services.store.model import (
    FEW_PASSING,
    KeywordResult,
    ListQuery,
    MemoryRow,
    Reach,
    Scored,
)
from services.store.rows import Rows
from services.store.validate import check_layers, page_size
from shared.errors import Conflict, InvalidArgument
from shared.limits import check_text
from shared.text import content_key

# Up to this many vectors an index is searched by brute force: a few ms, and unlike HNSW it
# cannot miss a row that near-duplicates crowd out of the graph.
EXACT_UP_TO = 20_000
# An approximate search fetches this many times k before filtering by scope, layer and status.
OVERSAMPLE = 4
# A distinct_text search's first pass fetches this many times k, as repeats of a text take
# places too. At 100,000 memories of the compare bench (pairs of turns: a sentence is in many
# memories), k 50 in-process: 4 took 2.18 passes a search, 8 took 1.38, 0.6-0.9 ms less at p50
# and p95; the wider first pass is also the more exact (HNSW's search widens with it: higher
# cosines at every rank).
DISTINCT_OVERSAMPLE = 8
# When filters or repeats leave too few of those, a vector search is widened twice over each
# time (a keyword search four times over), up to this many keys; past it, every key that passes
# the filters is scored. A distinct_text search whose repeats of a text fill the places reads no
# further down the ranking than this many keys (of the keys that pass, nearest first) or rows
# (best keyword score first), and gives fewer than k.
WIDEST = 16_384
# Keys scored at once in that last case: the memory it takes is bounded by this many vectors,
# not by the owner's (scoring all at once, a store of 1,000,000 memories grew to 23 GiB at its
# first searches and was killed).
EXACT_CHUNK = 65_536
MOST_SCORED_IDS = 100
"""The most rows one vector search scores by id (their cosines for hits another source found)."""


async def keyword_search(
    repo: Rows,
    reach: Reach,
    query: str,
    layers: Sequence[str] = (),
    k: int = 0,
    include_superseded: bool = False,
    min_terms: int = 0,
    context_keys: bool = False,
    distinct_text: bool = False,
) -> KeywordResult:
    """Rows containing enough of the query's terms, best score first (fulltext).

    min_terms 0 is the strict rule (required_terms); a positive value asks for at least that
    many terms. With context_keys, rows are also ranked by their context keys. With
    distinct_text, repeats of a text are left out (distinct) and k counts the rest.
    """
    check_layers(layers)
    check_text("query", query)
    if min_terms < 0:
        raise InvalidArgument("min_terms must not be negative")
    k = page_size(k, "k")
    terms = query_terms(query)
    required = required_terms(len(terms))
    if not terms:
        return KeywordResult([], [], 0)
    least = min(min_terms, len(terms)) if min_terms else required

    async def hits_of(index: str) -> list[Scored]:
        fetch = k
        while True:
            found = await repo.text_search(
                index, terms, least, reach, layers, include_superseded, fetch
            )
            kept = Kept(distinct_text)
            kept.add(Scored(r, s, n) for r, s, n in found)
            if not distinct_text or len(kept.hits) >= k or len(found) < fetch or fetch >= WIDEST:
                return kept.hits[:k]
            # Repeats of a text took the places: read further down the ranking.
            fetch = min(fetch * 4, WIDEST)

    # The two indexes are read side by side (each on its own connection), their hits annotated
    # together.
    indexes = ("own", "context") if context_keys else ("own",)
    hits, *around = await asyncio.gather(*(hits_of(index) for index in indexes))
    context = around[0] if around else []
    both = await annotated(repo, hits + context)
    return KeywordResult(both[: len(hits)], terms, required, both[len(hits) :])


class Kept:
    """Hits kept, best first; with distinct, less the repeats: a text a kept hit of the same
    owner and layer holds, or a hit found by one of its sentences that a kept hit of the same
    user holds word for word.

    A memory is as near a query as its nearest key, so every memory holding the sentence that
    matched (a fact noted again in later notes, a line quoted in several summaries) is as near
    as the first: the rest of each is not what was asked, and dozens of them would fill k.
    """

    def __init__(self, distinct: bool) -> None:
        self.hits: list[Scored] = []
        self._distinct = distinct
        self._texts: set[tuple[str, str, str, str]] = set()
        # Each user's kept texts, joined by a line break (no text holds one).
        self._joined: dict[str, str] = {}
        self._held: set[tuple[str, str]] = set()
        # A search asks about one sentence again and again as it reads on: each is keyed once.
        self._keys: dict[str, str] = {}

    @property
    def distinct(self) -> bool:
        """Whether repeats are left out."""
        return self._distinct

    def shows(self, user_id: str, passage: str) -> bool:
        """Whether a kept hit of the user holds passage (a sentence) word for word."""
        if not passage:
            return False
        key = self._keys.get(passage)
        if key is None:
            key = self._keys[passage] = content_key(passage)
        said = (user_id, key)
        if said in self._held or said[1] in self._joined.get(user_id, ""):
            self._held.add(said)
            return True
        return False

    def add(self, hits: Iterable[Scored]) -> None:
        """Keeps those of hits (best first, none better than a kept one) that repeat nothing."""
        for hit in hits:
            if not self._distinct or self._new(hit):
                self.hits.append(hit)

    def _new(self, hit: Scored) -> bool:
        """Whether hit repeats nothing kept; if so, what it shows counts as kept."""
        row = hit.memory
        text = (row.user_id, row.agent_id, row.layer, content_key(row.content))
        if text in self._texts or self.shows(row.user_id, hit.passage):
            return False
        self._texts.add(text)
        self._joined[row.user_id] = f"{self._joined.get(row.user_id, '')}\n{text[3]}"
        return True


async def annotated(repo: Rows, hits: list[Scored]) -> list[Scored]:
    """The hits with the older versions each replaced and, for turns, the turn each follows
    (one query for each)."""
    if not hits:
        return hits
    ids = [hit.memory.id for hit in hits]
    chains = await repo.replaced_by([hit.memory for hit in hits])
    followed = await repo.turns_followed(ids, sorted(CONTEXT_LAYERS), NEIGHBOUR_GAP_S)
    if not chains and not followed:
        return hits
    return [
        replace(
            hit,
            replaced=tuple(chains.get(hit.memory.id, ())),
            follows_id=followed.get(hit.memory.id, ""),
        )
        for hit in hits
    ]


async def vector_search(
    core: Core,
    reach: Reach,
    vector: Sequence[float],
    model_id: str,
    layers: Sequence[str] = (),
    k: int = 0,
    min_score: float = 0.0,
    include_superseded: bool = False,
    distinct_text: bool = False,
    ids: Sequence[str] = (),
) -> list[Scored]:
    """The k rows in reach most similar to vector (cosine), none below min_score; with
    distinct_text, repeats of a text are left out (distinct) and k counts the rest. With ids,
    only those rows, each scored exactly (_scored_ids)."""
    _check_model(core, model_id)
    check_layers(layers)
    query = _unit_query(core, vector)
    k = page_size(k, "k") if k or not ids else len(ids)
    if not -1.0 <= min_score <= 1.0:  # NaN too
        raise InvalidArgument(f"min_score {min_score} is not a cosine (-1 to 1; 0: no floor)")
    # 0 means no floor at all, negative cosines included.
    min_score = min_score if min_score > 0 else -np.inf
    assert core.indexes is not None
    if ids:
        scored = await _scored_ids(core, reach, query, ids, layers, include_superseded)
        hits = [hit for hit in scored if hit.score >= min_score]
    else:
        users = reach.user_ids if reach.user_ids is not None else await core.repo.user_ids()
        hits = []
        for user_id in users:
            one = replace(reach, user_ids=(user_id,))
            hits.extend(
                await _search_user(
                    core, one, query, layers, k, min_score, include_superseded, distinct_text
                )
            )
        hits.sort(key=lambda hit: hit.score, reverse=True)
    rows = await annotated(core.repo, hits[:k])
    # A re-embed may have switched models while this searched: its hits could come from
    # either model's index.
    _check_model(core, model_id)
    return rows


def _unit_query(core: Core, vector: Sequence[float]) -> np.ndarray:
    """The query vector at unit length; InvalidArgument for one of another size, zero or not
    finite."""
    query = np.asarray(vector, dtype=np.float32)
    if query.shape != (core.model.ndim,):
        raise InvalidArgument(
            f"vector has {query.size} dimensions; the store's model has {core.model.ndim}"
        )
    norm = float(np.linalg.norm(query))
    if norm == 0.0 or not np.isfinite(norm):
        raise InvalidArgument("vector must be finite and non-zero")
    return query / norm


async def _scored_ids(
    core: Core,
    reach: Reach,
    query: np.ndarray,
    ids: Sequence[str],
    layers: Sequence[str],
    include_superseded: bool,
) -> list[Scored]:
    """The given rows in reach and layers, each at the cosine of its nearest key, best first
    (a row with no vector is left out)."""
    if len(ids) > MOST_SCORED_IDS:
        raise InvalidArgument(f"at most {MOST_SCORED_IDS} ids are scored at once; got {len(ids)}")
    assert core.indexes is not None
    ids = list(dict.fromkeys(ids))
    rows = await core.repo.get_many(reach, ids, layers, include_superseded)
    keyed = await core.repo.keys_of(reach, list(rows))
    owner_of = dict(keyed)
    best: dict[str, float] = {}
    for user_id in {rows[memory_id].user_id for memory_id in rows}:
        wanted = [key for key, memory_id in keyed if rows[memory_id].user_id == user_id]
        keys, matrix = await core.indexes.vectors(user_id, wanted)
        for key, score in zip(keys, _cosines(matrix, query).tolist(), strict=True):
            memory_id = owner_of[key]
            best[memory_id] = max(score, best.get(memory_id, -np.inf))
    hits = [Scored(rows[memory_id], score) for memory_id, score in best.items()]
    return sorted(hits, key=lambda hit: hit.score, reverse=True)


def _cosines(matrix: np.ndarray, query: np.ndarray) -> np.ndarray:
    """The cosine of each row of matrix with a unit query (0 for a zero row)."""
    norms = np.linalg.norm(matrix, axis=1)
    norms[norms == 0] = 1.0
    return (matrix @ query) / norms


def _check_model(core: Core, model_id: str) -> None:
    """Refuses a query vector of another model than the store's."""
    if core.model.mismatch:
        raise Conflict(core.model.mismatch)
    if model_id != core.model.model_id:
        raise Conflict(
            f"the query vector comes from model {model_id!r} but the store holds "
            f"{core.model.model_id!r} vectors"
        )


async def _search_user(
    core: Core,
    reach: Reach,
    query: np.ndarray,
    layers: Sequence[str],
    k: int,
    min_score: float,
    include_superseded: bool,
    distinct_text: bool,
) -> list[Scored]:
    assert core.indexes is not None and reach.user_ids is not None
    count = max(k * (DISTINCT_OVERSAMPLE if distinct_text else OVERSAMPLE), 64)
    few: bool | None = None
    read = _Read(Kept(distinct_text))
    while True:
        found = await core.indexes.search(reach.user_ids[0], query, count, core.exact_up_to)
        if found.size == 0:
            return []
        keys, scores = found.keys, found.scores
        scored = list(zip(keys.tolist(), scores.tolist(), strict=True))
        hits = await _rows_of_best(
            core, reach, layers, include_superseded, scored, k, min_score, read
        )
        exhausted = count >= found.size or (len(scores) > 0 and scores[-1] < min_score)
        if len(hits) >= k or exhausted:
            return hits[:k]
        # Counted once, and only when the filters left out most rows read (not repeats).
        if few is None and read.filtered_most():
            few = await _few_pass(core, reach, layers, include_superseded)
        if few or count >= WIDEST:
            # The filters pass few of the nearest keys: score just the keys that pass.
            return await _exact(
                core, reach, query, layers, k, min_score, include_superseded, distinct_text
            )
        count = min(count * 2, WIDEST)


async def _few_pass(
    core: Core, reach: Reach, layers: Sequence[str], include_superseded: bool
) -> bool:
    """Whether at most FEW_PASSING rows lie inside the reach and layers."""
    query = ListQuery(layers=tuple(layers), include_superseded=include_superseded, limit=0)
    return (await core.repo.list_rows(reach, query)).total <= FEW_PASSING


Ranked = list[tuple[str, tuple[float, int]]]
"""Memories to look at, best first: each id with its best key's score and that key."""
Pending = deque[tuple[str, tuple[float, int]]]

MAP_SLICE = 128
"""Keys whose memories are looked up at once, nearest first, as far down a pass's keys as its
hits need. At 100,000 memories of the compare bench (pairs of turns: a sentence is in several
memories), a search of k 50 with repeats left out needed its 348 nearest keys (median; 772 at the
90th percentile); looking up each pass's keys all at once, it looked up 570, now 431."""


@dataclass
class _Read:
    """What the passes of one user's vector search have read, so that a wider pass reads only
    the rest: the memory behind each key and the sentence (if any) that found it, the rows read
    and not yet looked at, each memory looked at (whether its row passed the filters; a repeat
    counts as passing), the sentences whose first memory the filters left out, and the hits
    kept."""

    kept: Kept
    looked: dict[str, bool] = field(default_factory=dict)
    owners: dict[int, str | None] = field(default_factory=dict)
    passages: dict[int, str] = field(default_factory=dict)
    rows: dict[str, MemoryRow] = field(default_factory=dict)
    filtered: set[str] = field(default_factory=set)

    def filtered_most(self) -> bool:
        """Whether the filters (layers, retired rows) left out most of the rows looked at."""
        return sum(self.looked.values()) * 2 < len(self.looked)

    async def owners_of(self, repo: Rows, keys: list[int]) -> None:
        """Looks up the memory behind each key not looked up before (and for repeats the
        sentence that found it): once a search."""
        unknown = [key for key in keys if key not in self.owners]
        found = await repo.memories_of_keys(unknown)
        for key in unknown:
            memory_id, passage = found.get(key, (None, ""))
            self.owners[key] = memory_id
            if self.kept.distinct:
                self.passages[key] = passage


@dataclass
class _Unread:
    """One pass's keys, nearest first, and the memories behind them no pass has looked at yet,
    queued in the order of their nearest key (their best: the keys come nearest first), looked
    up a slice of keys at a time."""

    scored: list[tuple[int, float]]
    pending: Pending = field(default_factory=deque)
    queued: set[str] = field(default_factory=set)
    at: int = 0

    async def fill(self, repo: Rows, read: _Read, size: int) -> None:
        """Queues memories until size wait or the keys run out."""
        while len(self.pending) < size and self.at < len(self.scored):
            chunk = self.scored[self.at : self.at + MAP_SLICE]
            self.at += len(chunk)
            await read.owners_of(repo, [key for key, _ in chunk])
            for key, score in chunk:
                memory_id = read.owners[key]
                if memory_id is None or memory_id in read.looked or memory_id in self.queued:
                    continue
                self.queued.add(memory_id)
                self.pending.append((memory_id, (score, key)))


async def _rows_of_best(
    core: Core,
    reach: Reach,
    layers: Sequence[str],
    include_superseded: bool,
    scored: list[tuple[int, float]],
    k: int,
    min_score: float,
    read: _Read,
) -> list[Scored]:
    """The best k memories behind scored keys (nearest first), with those an earlier pass read:
    each memory at its best key's score, its row read once, a slice of memories at a time
    (most searches need one); repeats are left out when read.kept says so (Kept)."""
    unread = _Unread([item for item in scored if item[1] >= min_score])
    hits = read.kept.hits
    taken = 0
    while len(hits) < k:
        # As many as the hits missing, or as many as read so far when filters drop most.
        size = max((k - len(hits)) * 5 // 4 + 4, taken)
        await unread.fill(core.repo, read, size)
        if not unread.pending:
            break
        step, waiting = _step(reach, read, unread.pending, size)
        taken += len(step) - len(waiting)
        await _keep(core, reach, layers, include_superseded, read, (step, waiting), unread.pending)
    return hits[:k]


def _step(reach: Reach, read: _Read, pending: Pending, size: int) -> tuple[Ranked, set[str]]:
    """The next memories of pending to look at, best first, up to size rows to read, and those
    of them whose rows wait: a memory found by a sentence a kept hit shows is left out (a
    repeat), and of several found by one sentence only the first is read, the others waiting
    for it (kept, it shows them), unless the filters left out the first found by it before."""
    user_id = reach.user_ids[0] if reach.user_ids else ""
    step: Ranked = []
    waiting: set[str] = set()
    said: set[str] = set()
    while pending and len(step) - len(waiting) < size:
        memory_id, (score, key) = pending.popleft()
        passage = read.passages.get(key, "")
        if read.kept.shows(user_id, passage):
            read.looked[memory_id] = True
            continue
        if passage in said and passage not in read.filtered:
            waiting.add(memory_id)
        elif passage:
            said.add(passage)
        step.append((memory_id, (score, key)))
    return step, waiting


async def _keep(
    core: Core,
    reach: Reach,
    layers: Sequence[str],
    include_superseded: bool,
    read: _Read,
    looking: tuple[Ranked, set[str]],
    pending: Pending,
) -> None:
    """Reads the rows of a step (but those waiting) and keeps them in order. A waiting memory
    whose sentence the first one did not show (mostly: the filters left its row out) goes back
    to pending, with what follows it, so that hits are kept best first."""
    step, waiting = looking
    user_id = reach.user_ids[0] if reach.user_ids else ""
    ids = [m for m, _ in step if m not in waiting and m not in read.rows]
    read.rows.update(await core.repo.get_many(reach, ids, layers, include_superseded))
    for at, (memory_id, (score, key)) in enumerate(step):
        passage = read.passages.get(key, "")
        if memory_id in waiting and read.kept.shows(user_id, passage):
            read.looked[memory_id] = True
        elif memory_id in waiting:
            read.filtered.add(passage)
            pending.extendleft(reversed(step[at:]))
            return
        else:
            row = read.rows.pop(memory_id, None)
            read.looked[memory_id] = row is not None
            read.kept.add(() if row is None else (Scored(row, score, passage=passage),))


async def _exact(
    core: Core,
    reach: Reach,
    query: np.ndarray,
    layers: Sequence[str],
    k: int,
    min_score: float,
    include_superseded: bool,
    distinct_text: bool,
) -> list[Scored]:
    assert core.indexes is not None and reach.user_ids is not None
    candidates = await core.repo.keys_in(reach, layers, include_superseded)
    # A memory may hold several keys (its clauses): keep enough to fill k memories.
    keep = k * (1 + MOST_CLAUSES_HELD)
    # Scored once: a wider read of a distinct_text search takes more of these.
    widest = max(keep, WIDEST) if distinct_text else keep
    nearest = await _nearest(core, reach.user_ids[0], query, candidates, widest)
    read = _Read(Kept(distinct_text))
    while True:
        chosen = nearest[:keep]
        hits = await _rows_of_best(
            core, reach, layers, include_superseded, chosen, k, min_score, read
        )
        exhausted = len(chosen) < keep or chosen[-1][1] < min_score
        if len(hits) >= k or exhausted or keep >= widest:
            return hits
        # Repeats of a text took the places: take more of the nearest keys.
        keep = min(keep * 4, widest)


async def _nearest(
    core: Core, user_id: str, query: np.ndarray, candidates: list[int], keep: int
) -> list[tuple[int, float]]:
    """The `keep` candidate keys nearest the query, nearest first, with their cosines."""
    assert core.indexes is not None
    best_keys, best_scores = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    for start in range(0, len(candidates), EXACT_CHUNK):
        chunk = candidates[start : start + EXACT_CHUNK]
        keys, matrix = await core.indexes.vectors(user_id, chunk)
        if not keys:
            continue
        best_keys = np.concatenate([best_keys, np.asarray(keys, dtype=np.int64)])
        best_scores = np.concatenate([best_scores, _cosines(matrix, query)])
        top = np.argsort(-best_scores, kind="stable")[:keep]
        best_keys, best_scores = best_keys[top], best_scores[top]
    return [(int(key), float(score)) for key, score in zip(best_keys, best_scores, strict=True)]
