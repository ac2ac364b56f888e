"""A small user's vectors in a flat 8-bit matrix: the same answers as a usearch index, built
from SQLite rather than saved, and the switch to usearch (and back) as a user's number of
vectors crosses the bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from usearch.index import Index

from services.store import index as index_module
from services.store.flat_index import FlatIndex, is_flat_file
from services.store.index import (
    IndexChanges,
    VectorIndexes,
    index_file_name,
    new_index,
    read_index_file,
    resident_bytes_of,
)


def _rows(count: int, ndim: int = 16, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, ndim)).astype(np.float32)


def test_a_flat_index_stores_and_finds_what_a_usearch_index_does() -> None:
    vectors = _rows(300)
    keys = np.arange(1000, 1300, dtype=np.uint64)
    flat, graph = FlatIndex(16), new_index(16)
    flat.add(keys, vectors)
    graph.add(keys, vectors)
    assert np.array_equal(flat.vectors, np.stack(graph.get(keys, dtype="i8")))
    for query in _rows(5, seed=4):
        mine, theirs = flat.search(query, 10), graph.search(query, 10, exact=True)
        assert np.array_equal(mine.keys, theirs.keys)
        assert np.allclose(mine.distances, theirs.distances, atol=1e-6)
    got = flat.get(np.array([1005, 7], dtype=np.uint64))
    assert got[1] is None and got[0] is not None
    assert np.allclose(got[0], np.asarray(graph.get(np.uint64(1005), dtype="f32")))


def test_removed_keys_leave_a_flat_index_and_others_stay() -> None:
    flat = FlatIndex(16)
    flat.add(np.arange(1, 11, dtype=np.uint64), _rows(10))
    flat.remove([3, 7, 99])
    assert len(flat) == 8 and 3 not in flat and 4 in flat
    assert 3 not in flat.search(_rows(10)[2], 8).keys.tolist()
    assert flat.search(_rows(10)[3], 1).keys.tolist() == [4]


def _earlier_flat_file(path: Path, count: int) -> None:
    """A small index's file as a store before this one saved it: keys, then 8-bit rows."""
    with open(path, "wb") as out:
        np.save(out, np.arange(count, dtype=np.uint64), allow_pickle=False)
        np.save(out, np.zeros((count, 16), np.int8), allow_pickle=False)


def test_an_earlier_store_s_flat_index_file_is_told_from_a_usearch_file(tmp_path: Path) -> None:
    _earlier_flat_file(tmp_path / "flat", 5)
    graph = new_index(16)
    graph.add(np.arange(5, dtype=np.uint64), _rows(5))
    graph.save(str(tmp_path / "graph"))
    assert is_flat_file(tmp_path / "flat") and not is_flat_file(tmp_path / "graph")
    assert isinstance(read_index_file(tmp_path / "graph"), Index)


def test_a_flat_index_is_counted_by_its_arrays_and_smaller_than_usearch_s() -> None:
    vectors = _rows(280, ndim=384)
    flat, graph = FlatIndex(384), new_index(384)
    for start in range(0, 280, 4):  # grown as writes grow an index
        keys = np.arange(start, start + 4, dtype=np.uint64)
        flat.add(keys, vectors[start:start + 4])
        graph.add(keys, vectors[start:start + 4])
    assert resident_bytes_of(flat) >= 280 * 384
    assert resident_bytes_of(flat) < resident_bytes_of(graph) / 2


async def test_a_user_s_index_becomes_usearch_s_past_the_bound_and_flat_again_below_half(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_module, "FLAT_UP_TO", 20)
    vectors = _rows(31)
    held: set[int] = set()

    async def keys_of(user_id: str) -> set[int]:
        return set(held)

    async def fetch(keys: list[int]) -> np.ndarray:
        return vectors[keys]

    def changes(added: range = range(0), removed: range = range(0)) -> IndexChanges:
        change = IndexChanges()
        for key in added:
            change.add("ann", key, vectors[key])
            held.add(key)
        for key in removed:
            change.remove("ann", key)
            held.discard(key)
        return change

    indexes = VectorIndexes(tmp_path, 16, keys_of, fetch)
    indexes.open()
    path = tmp_path / index_file_name("ann")
    await indexes.apply(changes(added=range(1, 21)))
    await indexes.save()
    assert not path.exists()  # flat: built from SQLite when loaded
    await indexes.apply(changes(added=range(21, 31)))  # 30 vectors: past the bound
    assert (await indexes.search("ann", vectors[25], 1, exact_up_to=100)).keys.tolist() == [25]
    await indexes.save()
    assert not is_flat_file(path)
    await indexes.apply(changes(removed=range(1, 17)))  # 14 left: above half the bound
    await indexes.save()
    assert not is_flat_file(path)
    await indexes.apply(changes(removed=range(17, 22)))  # 9 left
    await indexes.save()
    assert not path.exists()  # flat again: its usearch file goes
    found = await indexes.search("ann", vectors[23], 9, exact_up_to=100)
    assert found.keys.tolist()[0] == 23 and sorted(found.keys.tolist()) == list(range(22, 31))


async def test_an_earlier_store_s_flat_file_gives_way_to_an_index_built_from_sqlite(
    tmp_path: Path,
) -> None:
    vectors = _rows(10)

    async def keys_of(user_id: str) -> set[int]:
        return set(range(10))

    async def fetch(keys: list[int]) -> np.ndarray:
        return vectors[keys]

    path = tmp_path / index_file_name("ann")
    _earlier_flat_file(path, 3)  # 3 of the 10 keys
    indexes = VectorIndexes(tmp_path, 16, keys_of, fetch)
    indexes.open()
    found = await indexes.search("ann", vectors[7], 10, exact_up_to=100)
    assert found.keys.tolist()[0] == 7 and sorted(found.keys.tolist()) == list(range(10))
    assert not path.exists()
