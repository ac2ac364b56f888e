"""Per-user usearch vector indexes (cosine), persisted under the data directory."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from usearch.index import Index

log = logging.getLogger(__name__)

SUFFIX = ".usearch"


@dataclass
class IndexChanges:
    """Vector keys one write removed and added, per owning user."""

    removed: dict[str, list[int]] = field(default_factory=dict)
    added: dict[str, list[tuple[int, np.ndarray]]] = field(default_factory=dict)

    def remove(self, user_id: str, key: int | None) -> None:
        """Notes that a key leaves a user's index."""
        if key is not None:
            self.removed.setdefault(user_id, []).append(key)

    def add(self, user_id: str, key: int, vector: np.ndarray) -> None:
        """Notes that a key joins a user's index."""
        self.added.setdefault(user_id, []).append((key, vector))


def index_file_name(user_id: str) -> str:
    """The file a user's index is saved in (hashed: user ids may hold any character)."""
    return hashlib.sha256(user_id.encode()).hexdigest()[:32] + SUFFIX


class VectorIndexes:
    """One usearch index per user; keys are the vectors table's keys."""

    def __init__(self, folder: Path, ndim: int) -> None:
        self.folder = folder
        self.ndim = ndim
        self._indexes: dict[str, Index] = {}
        self._dirty: set[str] = set()
        # usearch may not be searched while it grows; one lock keeps every call simple and safe.
        self._lock = asyncio.Lock()

    def _new(self) -> Index:
        return Index(ndim=self.ndim, metric="cos", dtype="f32")

    def _path(self, user_id: str) -> Path:
        return self.folder / index_file_name(user_id)

    def _restore(self, user_id: str) -> Index | None:
        path = self._path(user_id)
        if not path.exists():
            return None
        try:
            index = Index.restore(str(path))
        except Exception:
            log.warning("vector index %s is unreadable; rebuilding it", path, exc_info=True)
            return None
        if index is None or index.ndim != self.ndim:
            log.warning("vector index %s has the wrong shape; rebuilding it", path)
            return None
        return index

    async def load(
        self,
        keys_by_user: dict[str, set[int]],
        fetch: Callable[[list[int]], Awaitable[np.ndarray]],
    ) -> None:
        """Opens every user's saved index and brings it level with the keys SQLite holds."""
        self.folder.mkdir(parents=True, exist_ok=True)
        async with self._lock:
            for user_id, want in keys_by_user.items():
                index = await asyncio.to_thread(self._restore, user_id)
                if index is None:
                    index = self._new()
                    self._dirty.add(user_id)
                have = {int(k) for k in index.keys}
                stale = sorted(have - want)
                missing = sorted(want - have)
                if stale:
                    await asyncio.to_thread(index.remove, stale)
                if missing:
                    vectors = await fetch(missing)
                    await asyncio.to_thread(index.add, np.array(missing, dtype=np.uint64), vectors)
                if stale or missing:
                    log.info(
                        "vector index of %s caught up: %d added, %d removed",
                        index_file_name(user_id), len(missing), len(stale),
                    )
                    self._dirty.add(user_id)
                self._indexes[user_id] = index
            keep = {index_file_name(u) for u in keys_by_user}
            for path in self.folder.glob("*" + SUFFIX):
                if path.name not in keep:
                    path.unlink()
            for path in self.folder.glob("*.tmp"):
                path.unlink()  # a save cut short by a crash
        await self.save()

    async def apply(self, changes: IndexChanges) -> None:
        """Removes and adds the keys of one committed write."""
        async with self._lock:
            for user_id, keys in changes.removed.items():
                index = self._indexes.get(user_id)
                if index is not None:
                    await asyncio.to_thread(index.remove, keys)
                    self._dirty.add(user_id)
            for user_id, items in changes.added.items():
                index = self._indexes.get(user_id)
                if index is None:
                    index = self._indexes[user_id] = self._new()
                await asyncio.to_thread(
                    index.add,
                    np.array([key for key, _ in items], dtype=np.uint64),
                    np.stack([vector for _, vector in items]).astype(np.float32),
                )
                self._dirty.add(user_id)

    def users(self) -> list[str]:
        """The users that have an index."""
        return list(self._indexes)

    def size(self, user_id: str) -> int:
        """How many vectors a user's index holds."""
        index = self._indexes.get(user_id)
        return 0 if index is None else len(index)

    @property
    def total(self) -> int:
        """How many vectors all indexes hold."""
        return sum(len(index) for index in self._indexes.values())

    @property
    def dirty(self) -> bool:
        """Whether an index changed since it was last saved."""
        return bool(self._dirty)

    async def search(
        self, user_id: str, vector: np.ndarray, count: int, *, exact: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """The nearest keys in a user's index (brute force if exact) and their similarities."""
        async with self._lock:
            index = self._indexes.get(user_id)
            if index is None or len(index) == 0:
                return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.float32)
            matches = await asyncio.to_thread(
                index.search, vector, min(count, len(index)), exact=exact
            )
        return np.asarray(matches.keys), 1.0 - np.asarray(matches.distances, dtype=np.float32)

    async def vectors(self, user_id: str, keys: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """The vectors of the given keys that a user's index holds, with their keys."""
        async with self._lock:
            index = self._indexes.get(user_id)
            if index is None or not keys:
                return [], np.zeros((0, self.ndim), dtype=np.float32)
            got = await asyncio.to_thread(index.get, np.array(keys, dtype=np.uint64))
        if got is None:
            return [], np.zeros((0, self.ndim), dtype=np.float32)
        if isinstance(got, np.ndarray):
            if got.ndim == 2:
                return list(keys), got.astype(np.float32, copy=False)
            got = (got,)
        found = [(key, v) for key, v in zip(keys, got, strict=True) if v is not None]
        if not found:
            return [], np.zeros((0, self.ndim), dtype=np.float32)
        return [key for key, _ in found], np.stack([v for _, v in found]).astype(np.float32)

    async def save(self) -> int:
        """Writes every changed index to disk (atomically, via a temporary file)."""
        async with self._lock:
            for user_id in sorted(self._dirty):
                index = self._indexes.get(user_id)
                path = self._path(user_id)
                if index is None or len(index) == 0:
                    self._indexes.pop(user_id, None)
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    continue
                tmp = path.with_suffix(".tmp")
                await asyncio.to_thread(index.save, str(tmp))
                os.replace(tmp, path)
            self._dirty.clear()
            return sum(len(index) for index in self._indexes.values())
