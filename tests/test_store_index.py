"""The vector indexes' lock (writes are not starved, a save does not hold up searches), loads a
caller gives up on, and how a large index is written (from a forked child)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
from usearch.index import Index

from services.store.flat_index import FlatIndex
from services.store.index import (
    INDEX_OVERHEAD_BYTES,
    IndexChanges,
    ReadWriteLock,
    VectorIndexes,
    index_file_name,
    new_index,
    read_index_file,
    resident_bytes_of,
)
from services.store.index_save import DETACH_FROM_BYTES, Detached, save_index
from shared.errors import Conflict
from tests.support import WAIT_CEILING_S


async def settle() -> None:
    """Lets every task that can run, run (the loop goes round until nothing is ready)."""
    for _ in range(50):
        await asyncio.sleep(0)


def holder(
    order: list[str], name: str, enter: Callable[[], contextlib.AbstractAsyncContextManager[None]]
) -> tuple[asyncio.Event, Callable[[], asyncio.Task[None]]]:
    release = asyncio.Event()

    async def hold() -> None:
        async with enter():
            order.append(name)
            await release.wait()

    return release, lambda: asyncio.create_task(hold())


async def test_a_waiting_write_goes_before_later_searches() -> None:
    lock, order = ReadWriteLock(), []
    first, start_first = holder(order, "search 1", lock.reading)
    write, start_write = holder(order, "write", lock.writing)
    second, start_second = holder(order, "search 2", lock.reading)
    tasks = [start_first()]
    await settle()
    tasks += [start_write()]
    await settle()
    tasks += [start_second()]
    await settle()
    assert order == ["search 1"]
    first.set()
    await settle()
    assert order == ["search 1", "write"]
    write.set()
    second.set()
    await asyncio.gather(*tasks)
    assert order == ["search 1", "write", "search 2"]


async def test_searches_go_on_beside_a_save_that_a_write_waits_for() -> None:
    lock, order = ReadWriteLock(), []

    @contextlib.asynccontextmanager
    async def saving() -> AsyncIterator[None]:
        async with lock.reading(saving=True):
            yield

    save, start_save = holder(order, "save", saving)
    write, start_write = holder(order, "write", lock.writing)
    search, start_search = holder(order, "search", lock.reading)
    tasks = [start_save()]
    await settle()
    tasks += [start_write()]
    await settle()
    tasks += [start_search()]
    await settle()
    assert order == ["save", "search"]
    search.set()
    save.set()
    write.set()
    await asyncio.gather(*tasks)
    assert order == ["save", "search", "write"]


def _unit_rows(count: int, ndim: int = 8) -> np.ndarray:
    rows = np.random.default_rng(7).normal(size=(count, ndim)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


async def test_a_load_goes_on_when_the_search_that_started_it_gives_up(tmp_path: Path) -> None:
    vectors = _unit_rows(3)
    fetched: list[list[int]] = []
    entered, release = asyncio.Event(), asyncio.Event()

    async def keys_of(user_id: str) -> set[int]:
        return {1, 2, 3}

    async def fetch(keys: list[int]) -> np.ndarray:
        fetched.append(keys)
        entered.set()
        await release.wait()  # a large index being read from SQLite
        return vectors[[key - 1 for key in keys]]

    indexes = VectorIndexes(tmp_path, 8, keys_of, fetch)
    indexes.open()
    search = asyncio.create_task(indexes.search("alice", vectors[1], 3, exact_up_to=0))
    await asyncio.wait_for(entered.wait(), WAIT_CEILING_S)  # the load reads a file first
    assert fetched == [[1, 2, 3]]
    search.cancel()  # the search's deadline passed
    with contextlib.suppress(asyncio.CancelledError):
        await search
    release.set()
    # A write meanwhile waits for the same load, and does not add the keys it already read.
    changes = IndexChanges()
    changes.add("alice", 3, vectors[2])
    await indexes.apply(changes)
    found = await indexes.search("alice", vectors[1], 3, exact_up_to=0)
    assert fetched == [[1, 2, 3]]  # loaded once
    assert found.size == 3 and int(found.keys[0]) == 2


async def test_a_committed_write_reaches_its_index_though_its_caller_gives_up(
    tmp_path: Path,
) -> None:
    vectors = _unit_rows(4)
    entered, release = asyncio.Event(), asyncio.Event()

    async def keys_of(user_id: str) -> set[int]:
        return {1, 2, 3}  # read before the write below committed

    async def fetch(keys: list[int]) -> np.ndarray:
        entered.set()
        await release.wait()
        return vectors[[key - 1 for key in keys]]

    indexes = VectorIndexes(tmp_path, 8, keys_of, fetch)
    indexes.open()
    search = asyncio.create_task(indexes.search("alice", vectors[0], 4, exact_up_to=0))
    await asyncio.wait_for(entered.wait(), WAIT_CEILING_S)
    changes = IndexChanges()
    changes.add("alice", 4, vectors[3])
    write = asyncio.create_task(indexes.apply(changes))
    await settle()
    assert not write.done()  # waiting for the load
    write.cancel()  # the write's deadline passed while it waited for the load
    with contextlib.suppress(asyncio.CancelledError):
        await write
    release.set()
    await search
    found = await indexes.search("alice", vectors[3], 4, exact_up_to=0)
    assert found.size == 4 and int(found.keys[0]) == 4


async def test_a_search_overtaken_by_a_switch_to_other_dimensions_is_refused(
    tmp_path: Path,
) -> None:
    async def keys_of(user_id: str) -> set[int]:
        return {1, 2}

    async def fetch(keys: list[int]) -> np.ndarray:
        return _unit_rows(len(keys), indexes.ndim)  # the vectors of the model now served

    indexes = VectorIndexes(tmp_path, 8, keys_of, fetch)
    indexes.open()
    async with indexes.switching(4):
        search = asyncio.create_task(indexes.search("alice", _unit_rows(1)[0], 2, 0))
        await settle()
    with pytest.raises(Conflict, match="4 dimensions"):
        await search


class HeldSaves:
    """Vector indexes of 8-d keys whose saves are recorded and hold, the first one till
    released, inside the save's thread."""

    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
        self.vectors = _unit_rows(count)
        self.events: list[str] = []
        self.first_in, self.release = threading.Event(), threading.Event()
        monkeypatch.setattr("services.store.index.save_index", self._held_save)
        monkeypatch.setattr("services.store.index.FLAT_UP_TO", 0)  # usearch's: saved

        async def keys_of(user_id: str) -> set[int]:
            return set()

        async def fetch(keys: list[int]) -> np.ndarray:
            return self.vectors[[key - 1 for key in keys]]

        self.indexes = VectorIndexes(folder, 8, keys_of, fetch)
        self.indexes.open()

    def _held_save(self, index: Index, path: str) -> None:
        self.events.append("start")
        self.first_in.set()
        self.release.wait(WAIT_CEILING_S)
        save_index(index, path)
        self.events.append("end")

    async def changed(self) -> None:
        """alice's index holds every vector (keys from 1)."""
        changes = IndexChanges()
        for key, vector in enumerate(self.vectors, start=1):
            changes.add("alice", key, vector)
        await self.indexes.apply(changes)

    async def first_save_in_its_thread(self) -> asyncio.Task[int]:
        save = asyncio.create_task(self.indexes.save())
        await asyncio.to_thread(self.first_in.wait, WAIT_CEILING_S)
        return save


async def test_two_saves_at_once_write_an_index_one_after_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldSaves(tmp_path, monkeypatch, 3)
    await held.changed()
    periodic = await held.first_save_in_its_thread()
    flush = asyncio.create_task(held.indexes.save())  # while the periodic save writes the file
    await settle()
    held.release.set()
    assert await periodic == 3 and await flush == 3
    assert held.events == ["start", "end"]  # the second found nothing changed since
    assert sorted(os.listdir(tmp_path)) == [index_file_name("alice")]  # no .tmp left
    assert len(read_index_file(tmp_path / index_file_name("alice")) or ()) == 3


async def test_a_save_whose_caller_gives_up_finishes_before_the_next_one_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldSaves(tmp_path, monkeypatch, 2)
    await held.changed()
    flush = await held.first_save_in_its_thread()
    flush.cancel()  # the flush's deadline passed while the file is written
    with pytest.raises(asyncio.CancelledError):
        await flush
    last = asyncio.create_task(held.indexes.save())  # as the store's close saves
    await settle()
    held.release.set()
    assert await last == 2
    assert held.events == ["start", "end"]  # the last save waited, and found nothing left
    assert sorted(os.listdir(tmp_path)) == [index_file_name("alice")]


def _index_of(count: int) -> Index:
    index = new_index(384)
    vectors = np.random.default_rng(5).standard_normal((count, 384)).astype(np.float32)
    index.add(np.arange(count, dtype=np.uint64), vectors)
    return index


def test_a_large_index_is_written_by_a_forked_child_and_reads_back_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forks: list[int] = []
    real_fork = os.fork

    def counted_fork() -> int:
        pid = real_fork()
        if pid:
            forks.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", counted_fork)
    index = _index_of(8000)
    assert index.serialized_length >= DETACH_FROM_BYTES
    path = tmp_path / "big.usearch"
    save_index(index, str(path))
    assert len(forks) == 1
    back = Index.restore(str(path))
    assert back is not None and len(back) == len(index)
    keys = np.arange(0, 8000, 997, dtype=np.uint64)
    assert np.array_equal(back.get(keys), index.get(keys))


def test_a_small_index_is_written_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("a small index must not fork"))
    index = _index_of(100)
    save_index(index, str(tmp_path / "small.usearch"))
    assert len(Index.restore(str(tmp_path / "small.usearch"))) == 100


def test_a_save_the_child_cannot_make_is_tried_here_and_its_error_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    index = _index_of(8000)
    with pytest.raises(RuntimeError):
        save_index(index, str(tmp_path / "missing-folder" / "big.usearch"))
    # The warning says why the child failed, in the child's own words.
    [warning] = [r.getMessage() for r in caplog.records if "forked save" in r.getMessage()]
    assert "(RuntimeError: " in warning


async def test_the_cache_budget_holds_as_many_small_indexes_as_their_memory_allows(
    tmp_path: Path,
) -> None:
    # 40 owners of 3 vectors each take a few MiB (flat indexes since 2026-12-05; usearch's
    # memory_usage said 16 MiB apiece: test_a_usearch_index_is_counted_by_what_it_holds).
    owners = [f"u{i}" for i in range(40)]
    vectors = _unit_rows(3 * len(owners))
    loads: list[str] = []

    async def keys_of(user_id: str) -> set[int]:
        loads.append(user_id)
        first = 3 * owners.index(user_id) + 1
        return set(range(first, first + 3))

    async def fetch(keys: list[int]) -> np.ndarray:
        return vectors[[key - 1 for key in keys]]

    indexes = VectorIndexes(tmp_path, 8, keys_of, fetch, budget_bytes=16 * 1024 * 1024)
    indexes.open()
    for _ in range(2):
        for number, owner in enumerate(owners):
            found = await indexes.search(owner, vectors[3 * number], 3, exact_up_to=0)
            assert int(found.keys[0]) == 3 * number + 1
    assert loads == owners  # each loaded once, none evicted and loaded again
    assert 0 < indexes.resident_bytes <= 16 * 1024 * 1024


@pytest.mark.parametrize("kind", ["flat", "usearch"])
async def test_indexes_past_the_cache_budget_are_evicted_oldest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """An evicted usearch index is saved and loaded again from its file; a flat one is built
    from SQLite again, no file written for it."""
    vectors = _unit_rows(600)
    loads: list[str] = []

    async def keys_of(user_id: str) -> set[int]:
        loads.append(user_id)
        return set(range(1, 301)) if user_id == "a" else set(range(301, 601))

    async def fetch(keys: list[int]) -> np.ndarray:
        return vectors[[key - 1 for key in keys]]

    if kind == "usearch":
        monkeypatch.setattr("services.store.index.FLAT_UP_TO", 0)
    probe = FlatIndex(8) if kind == "flat" else new_index(8)
    probe.add(np.arange(1, 301, dtype=np.uint64), vectors[:300])
    budget = resident_bytes_of(probe) + 1  # room for one of the two
    indexes = VectorIndexes(tmp_path, 8, keys_of, fetch, budget_bytes=budget)
    indexes.open()
    await indexes.search("a", vectors[0], 1, exact_up_to=0)
    await indexes.search("b", vectors[300], 1, exact_up_to=0)  # evicts a
    saved = [index_file_name("a")] if kind == "usearch" else []
    assert sorted(os.listdir(tmp_path)) == saved
    found = await indexes.search("a", vectors[5], 1, exact_up_to=0)
    assert int(found.keys[0]) == 6
    assert loads == ["a", "b", "a"]


async def test_a_write_goes_between_the_indexes_a_save_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vectors = _unit_rows(3)
    gate = threading.Semaphore(0)
    saved: list[str] = []

    def gated_save(index: Index, path: str) -> None:
        gate.acquire(timeout=WAIT_CEILING_S)
        save_index(index, path)
        saved.append(Path(path).stem)

    async def keys_of(user_id: str) -> set[int]:
        return set()

    async def fetch(keys: list[int]) -> np.ndarray:
        return vectors[[key - 1 for key in keys]]

    monkeypatch.setattr("services.store.index.save_index", gated_save)
    monkeypatch.setattr("services.store.index.FLAT_UP_TO", 0)  # usearch's: saved
    indexes = VectorIndexes(tmp_path, 8, keys_of, fetch)
    indexes.open()
    for key, owner in enumerate(["alice", "bob"], start=1):
        changes = IndexChanges()
        changes.add(owner, key, vectors[key - 1])
        await indexes.apply(changes)
    save = asyncio.create_task(indexes.save())
    await settle()
    later = IndexChanges()
    later.add("alice", 3, vectors[2])
    write = asyncio.create_task(indexes.apply(later))  # waits for the index being saved
    await settle()
    assert not write.done()
    gate.release()  # alice's index is written; bob's save waits at the gate
    await asyncio.wait_for(write, WAIT_CEILING_S)
    assert len(saved) == 1 and not save.done()
    gate.release()
    assert await save == 3
    assert len(saved) == 2 and indexes.dirty  # alice changed again after her save


async def test_a_write_goes_on_while_a_forked_child_writes_its_large_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = 8000  # a usearch index past DETACH_FROM_BYTES
    vectors = _unit_rows(count + 1, 384)
    child_has_its_image, gate = threading.Event(), threading.Event()
    wait_for_child = Detached.failure

    def held(detached: Detached) -> str:
        child_has_its_image.set()
        gate.wait(WAIT_CEILING_S)
        return wait_for_child(detached)

    async def keys_of(user_id: str) -> set[int]:
        return set()

    async def fetch(keys: list[int]) -> np.ndarray:
        return vectors[[key - 1 for key in keys]]

    monkeypatch.setattr(Detached, "failure", held)
    indexes = VectorIndexes(tmp_path, 384, keys_of, fetch)
    indexes.open()
    changes = IndexChanges()
    for key in range(1, count + 1):
        changes.add("alice", key, vectors[key - 1])
    await indexes.apply(changes)
    save = asyncio.create_task(indexes.save())
    await asyncio.to_thread(child_has_its_image.wait, WAIT_CEILING_S)
    later = IndexChanges()
    later.add("alice", count + 1, vectors[count])
    await asyncio.wait_for(indexes.apply(later), WAIT_CEILING_S)  # not held by the save
    assert not save.done()
    gate.set()
    await save
    path = tmp_path / index_file_name("alice")
    assert len(read_index_file(path) or ()) == count  # the index as it was at the fork
    assert indexes.dirty  # the later write is still to save
    await indexes.save()
    assert len(read_index_file(path) or ()) == count + 1 and not indexes.dirty
    assert sorted(os.listdir(tmp_path)) == [index_file_name("alice")]  # no .tmp left


def test_a_usearch_index_is_counted_by_what_it_holds() -> None:
    # usearch's memory_usage counts the 16 MiB block an index reserves, whatever it holds.
    index = _index_of(3)
    assert resident_bytes_of(index) < index.memory_usage / 8
    assert resident_bytes_of(index) >= index.serialized_length


@pytest.mark.parametrize("count", [40, 600, 3000])
def test_a_usearch_index_is_counted_at_twice_its_serialized_length_without_asking_usearch(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = _index_of(count)
    twice = 2 * index.serialized_length + INDEX_OVERHEAD_BYTES
    # Both walk every node: not to be asked at each write of a large index.
    for walk in ("serialized_length", "memory_usage"):
        asked = property(lambda _, walk=walk: pytest.fail(f"{walk} asked"))
        monkeypatch.setattr(Index, walk, asked)
    assert resident_bytes_of(index) == pytest.approx(twice, rel=0.01)
