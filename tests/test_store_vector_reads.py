"""How a vector search reads the memories behind its nearest keys (`retrieval._rows_of_best`),
on a real SQLite store, against the rule it must keep: the memories behind the keys, each at its
best key's score, best first, less those the filters leave out and, with distinct_text, the
repeats `Kept` leaves out; the first k. However the search steps through them (the first of
several memories found by one sentence read alone, a wider pass after a narrower one), the
hits are the rule's."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.store import retrieval
from services.store.core import Core
from services.store.keys import CLAUSE
from services.store.model import ACTIVE, LAYERS, MemoryRow, Reach, Scored
from services.store.repo import Repo

SENTENCES = [
    "Priya moved to Lisbon in May.",
    "The review slipped to Thursday.",
    "Sam drinks a flat white.",
    "The auditors came late again.",
]
L2, L3 = LAYERS[1], LAYERS[2]


@dataclass(frozen=True)
class Note:
    """A memory of the example: its agent, layer, status, sentences, and which of those are
    its sentence keys."""

    agent: str
    layer: str
    retired: bool
    sentences: tuple[int, ...]
    keyed: tuple[int, ...]


notes = st.builds(
    Note,
    agent=st.sampled_from(["a", "b"]),
    layer=st.sampled_from([L2, L3]),
    retired=st.booleans(),
    sentences=st.lists(st.integers(0, 2), min_size=1, max_size=3).map(tuple),
    keyed=st.lists(st.integers(0, 2), max_size=3, unique=True).map(tuple),
)


@dataclass(frozen=True)
class Search:
    agent: str
    layers: tuple[str, ...]
    k: int
    distinct: bool
    narrower: int
    """How many of the nearest keys a first, narrower pass takes."""
    looked_up: int = retrieval.MAP_SLICE
    """How many keys' memories are looked up at once."""


searches = st.builds(
    Search,
    agent=st.sampled_from(["", "a"]),
    layers=st.sampled_from([(), (L2,)]),
    k=st.integers(1, 8),
    distinct=st.booleans(),
    narrower=st.integers(1, 60),
    looked_up=st.integers(1, 20),
)


@contextlib.contextmanager
def _looked_up_at_once(count: int) -> Iterator[None]:
    """retrieval.MAP_SLICE at count for the while."""
    before = retrieval.MAP_SLICE
    retrieval.MAP_SLICE = count
    try:
        yield
    finally:
        retrieval.MAP_SLICE = before


async def _write(
    repo: Repo, written: list[Note]
) -> tuple[dict[int, str], dict[str, MemoryRow], dict[int, str]]:
    """The notes as rows of user u with their keys; each key's memory id, the rows, and each
    sentence key's sentence."""
    owners: dict[int, str] = {}
    passages: dict[int, str] = {}
    rows: dict[str, MemoryRow] = {}
    vector = np.ones(4, dtype=np.float32)
    async with repo.transaction() as tx:
        for i, note in enumerate(written):
            words = [SENTENCES[s] for s in note.sentences]
            row = MemoryRow(
                id=f"m{i}", user_id="u", agent_id=note.agent, session_id="", layer=note.layer,
                content=" ".join(words), model_id="m",
                status="forgotten" if note.retired else ACTIVE,
            )
            rows[row.id] = row
            owners[await tx.insert(row, vector)] = row.id
            for at in sorted(set(note.keyed) & set(range(len(words)))):
                key = await tx.add_clause_key(row.id, CLAUSE, words[at], "m", vector)
                owners[key], passages[key] = row.id, words[at]
    return owners, rows, passages


def _rule(
    scored: list[tuple[int, float]],
    owners: dict[int, str],
    passes: dict[str, MemoryRow],
    passages: dict[int, str],
    search: Search,
) -> list[tuple[str, float]]:
    """What the search must give: each memory at its best key's score, best first (ties in the
    order the keys came), those that pass the filters, through Kept, the first k."""
    best: dict[str, tuple[float, int]] = {}
    for key, score in scored:
        if score > best.get(owners[key], (-np.inf, 0))[0]:
            best[owners[key]] = (score, key)
    kept = retrieval.Kept(search.distinct)
    for memory_id, (score, key) in sorted(best.items(), key=lambda i: i[1][0], reverse=True):
        if memory_id in passes:
            passage = passages.get(key, "") if search.distinct else ""
            kept.add([Scored(passes[memory_id], score, passage=passage)])
    return [(hit.memory.id, hit.score) for hit in kept.hits[: search.k]]


async def _check(written: list[Note], scores: list[float], search: Search) -> None:
    with tempfile.TemporaryDirectory() as folder:
        async with Repo(Path(folder) / "hyatlas.db") as repo:
            owners, rows, passages = await _write(repo, written)
            # The nearest keys as an index gives them: best first.
            keys = sorted(owners)
            scored = sorted(
                zip(keys, (scores * len(keys))[: len(keys)], strict=True),
                key=lambda item: item[1], reverse=True,
            )
            passes = {
                m: row for m, row in rows.items()
                if row.status == ACTIVE and search.agent in ("", row.agent_id)
                and (not search.layers or row.layer in search.layers)
            }
            core = cast(Core, SimpleNamespace(repo=repo))
            reach = Reach(("u",), search.agent)
            read = retrieval._Read(retrieval.Kept(search.distinct))

            async def looked_through(nearest: list[tuple[int, float]]) -> list[Any]:
                return await retrieval._rows_of_best(
                    core, reach, search.layers, False, nearest, search.k, 0.0, read,
                )

            with _looked_up_at_once(search.looked_up):
                hits = await looked_through(scored[: search.narrower])
                if len(hits) < search.k:
                    hits = await looked_through(scored)
            found = [(hit.memory.id, hit.score) for hit in hits]
            assert found == _rule(scored, owners, passes, passages, search)


@settings(max_examples=150, deadline=None)
# The nearest two notes are found by one sentence and the nearer is another agent's: the search
# reads it alone, and when the filters leave it out reads the other.
@example(
    written=[
        Note("b", L2, retired=False, sentences=(0, 1), keyed=(0,)),
        Note("a", L2, retired=False, sentences=(0, 2), keyed=(0,)),
        Note("a", L2, retired=False, sentences=(1,), keyed=()),
    ],
    # Own keys first (m0, m1, m2), then the sentence keys (m0's, m1's).
    scores=[0.5, 0.5, 0.6, 0.9, 0.8],
    search=Search("a", (), k=2, distinct=True, narrower=60),
)
@given(
    written=st.lists(notes, min_size=1, max_size=24),
    scores=st.lists(st.sampled_from([0.9, 0.8, 0.7, 0.6, 0.5]), min_size=1, max_size=80),
    search=searches,
)
def test_a_vector_search_reads_its_candidates_into_the_hits_the_rule_gives(
    written: list[Note], scores: list[float], search: Search
) -> None:
    asyncio.run(_check(written, scores, search))


def test_a_vector_search_looks_up_the_memories_of_the_nearest_keys_only_as_far_as_it_needs() -> (
    None
):
    asyncio.run(_check_depth())


async def _check_depth() -> None:
    """40 memories, each found by its own key; k 3 takes the first slice of keys alone."""
    with tempfile.TemporaryDirectory() as folder:
        async with Repo(Path(folder) / "hyatlas.db") as repo:
            written = [Note("a", L2, retired=False, sentences=(0,), keyed=()) for _ in range(40)]
            owners, _, _ = await _write(repo, written)
            scored = [(key, 1.0 - i / 100) for i, key in enumerate(sorted(owners))]
            asked: list[int] = []
            looked_up = repo.memories_of_keys

            async def counted(keys: Sequence[int]) -> dict[int, tuple[str, str]]:
                asked.extend(keys)
                return await looked_up(keys)

            core = cast(Core, SimpleNamespace(repo=SimpleNamespace(
                memories_of_keys=counted, get_many=repo.get_many
            )))
            read = retrieval._Read(retrieval.Kept(False))
            with _looked_up_at_once(8):
                hits = await retrieval._rows_of_best(
                    core, Reach(("u",)), (), False, scored, 3, 0.0, read
                )
            assert [hit.memory.id for hit in hits] == [owners[key] for key, _ in scored[:3]]
            assert asked == [key for key, _ in scored[:8]]
