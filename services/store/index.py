"""Per-user vector indexes (cosine, 8-bit components), loaded on demand, least recently used
evicted: a flat matrix while a user has few vectors (flat_index), built from SQLite whenever it
is loaded, and a usearch index once they have more, persisted under the data directory.

SQLite holds every vector (8-bit); an index is a cache of one user's. A usearch index is opened
from its file on the first search or write that needs it and caught up with SQLite's keys then
(after a crash, the keys written since its last save). A file of another precision (a store from
before 8-bit indexes) is rebuilt from SQLite.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import itertools
import logging
import shutil
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from usearch.index import Index, ScalarKind

from services.store.durable import put_in_place, synced
from services.store.flat_index import FLAT_UP_TO, FlatIndex, is_flat_file
from services.store.index_save import begin_save, save_index
from services.store.repo import as_stored
from shared.errors import Conflict

log = logging.getLogger(__name__)

# A user's index file holds a usearch index (an earlier store's may hold a FlatIndex's save).
SUFFIX = ".usearch"
# Loaded indexes are evicted, least recently used first, beyond this much memory.
DEFAULT_BUDGET_BYTES = 512 * 1024 * 1024
# How an index stores a vector: a unit vector's components times 127, as 8-bit integers. Half
# the memory and disk of half precision; LoCoMo's overall recall and NDCG as with half (README).
PRECISION = ScalarKind.I8
# A search for this many keys or fewer runs on the event loop (see VectorIndexes.search).
QUICK_SEARCH_KEYS = 1024
# What an index holds in memory besides its serialized form, at most (see resident_bytes_of).
INDEX_OVERHEAD_BYTES = 96 * 1024
# What a usearch node holds in its file besides its vector (ndim bytes at PRECISION): its key,
# its level and its links (usearch's default connectivity; 532.5 bytes in all for a vector of 384
# dimensions, measured from 100 to 100,000 vectors).
NODE_BYTES_BESIDES_VECTOR = 149

AnyIndex = Index | FlatIndex
KeysOf = Callable[[str], Awaitable[set[int]]]
FetchVectors = Callable[[list[int]], Awaitable[np.ndarray]]


@dataclass
class IndexChanges:
    """Vector keys one write removed and added, per owning user."""

    removed: dict[str, list[int]] = field(default_factory=dict)
    added: dict[str, list[tuple[int, np.ndarray]]] = field(default_factory=dict)
    every_core: bool = False
    """Whether the keys may go into usearch on every core: the write embedded nothing (an
    import of an export's vectors), so no model run of its next batch needs the cores."""

    def remove(self, user_id: str, key: int | None) -> None:
        """Notes that a key leaves a user's index."""
        if key is not None:
            self.removed.setdefault(user_id, []).append(key)

    def add(self, user_id: str, key: int, vector: np.ndarray) -> None:
        """Notes that a key joins a user's index."""
        self.added.setdefault(user_id, []).append((key, vector))


@dataclass(frozen=True)
class Matches:
    """The nearest keys of one search, their cosine similarities, and the index's size (a
    backend may stop counting past the search's count and exact_up_to: then any larger number)."""

    keys: np.ndarray
    scores: np.ndarray
    size: int


def new_index(ndim: int) -> Index:
    """An empty index: cosine, stored at PRECISION."""
    return Index(ndim=ndim, metric="cos", dtype=PRECISION)


def resident_bytes_of(index: AnyIndex) -> int:
    """About the memory an index holds, as the cache budget counts it (a flat one: its arrays).

    Counted from the number of vectors, not asked of usearch: its memory_usage and
    serialized_length walk every node (5 ms each at 300,000 vectors), and the count is redone
    at every write. memory_usage also counts the 16 MiB block a new index reserves, of which a
    small index touches a few pages (200 indexes of 100 vectors took 25 MB of resident memory
    while it said 3.4 GB). Measured (384 dimensions at 8 bits), an index read from its file took
    1.2 times its serialized length (1,000 to 50,000 vectors) and one of a single vector about 72
    KiB; one grown by adds reserves room ahead, so twice the serialized length is counted, plus
    INDEX_OVERHEAD_BYTES.
    """
    if isinstance(index, FlatIndex):
        return index.memory_usage
    serialized = len(index) * (index.ndim + NODE_BYTES_BESIDES_VECTOR)
    return 2 * serialized + INDEX_OVERHEAD_BYTES


def empty_index(ndim: int, size: int) -> AnyIndex:
    """An empty index of the kind that size vectors take (see fits)."""
    return FlatIndex(ndim) if size <= FLAT_UP_TO else new_index(ndim)


def fits(index: AnyIndex) -> bool:
    """Whether an index is of the kind its number of vectors takes: flat up to FLAT_UP_TO,
    usearch's above. A usearch index goes back to flat only at half that, so a user at the
    bound does not rebuild a graph at every write."""
    if isinstance(index, FlatIndex):
        return len(index) <= FLAT_UP_TO
    return len(index) > FLAT_UP_TO // 2


def fitting(index: AnyIndex) -> AnyIndex:
    """The index itself if it fits, else its vectors in an index of the other kind (a graph of
    4,097 vectors took 0.28 s to build on two threads)."""
    if fits(index):
        return index
    if isinstance(index, FlatIndex):
        grown = new_index(index.ndim)
        grown.add(index.keys, index.vectors)
        return grown
    keys = np.asarray(index.keys, dtype=np.uint64)
    rows = index.get(keys, dtype="i8") if len(keys) else ()
    vectors = np.array(rows, dtype=np.int8).reshape(len(keys), index.ndim)
    return FlatIndex(index.ndim, keys, vectors)


def index_file_name(user_id: str) -> str:
    """The file a user's index is saved in (hashed: user ids may hold any character)."""
    return hashlib.sha256(user_id.encode()).hexdigest()[:32] + SUFFIX


class ReadWriteLock:
    """Many readers at once, or one writer. A waiting writer goes before new readers, except
    while a save (a long reader) holds the lock: searches then go on beside the save rather
    than queue behind a write that waits for it."""

    def __init__(self) -> None:
        self._readers = 0
        self._saves = 0
        self._writers_waiting = 0
        self._writing = False
        self._changed = asyncio.Condition()

    def _may_read(self) -> bool:
        return not self._writing and (self._writers_waiting == 0 or self._saves > 0)

    @contextlib.asynccontextmanager
    async def reading(self, *, saving: bool = False) -> AsyncIterator[None]:
        """Held while a search or (saving) a save reads an index."""
        async with self._changed:
            await self._changed.wait_for(self._may_read)
            self._readers += 1
            self._saves += saving
        try:
            yield
        finally:
            async with self._changed:
                self._readers -= 1
                self._saves -= saving
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """Held while an index is changed, loaded or evicted."""
        async with self._changed:
            self._writers_waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._writing and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            async with self._changed:
                self._writing = False
                self._changed.notify_all()


def _keys_in(index: AnyIndex) -> set[int]:
    """Every key an index holds, read in one call: usearch looks each key up by offset when
    index.keys is iterated, which grows with the square of its size (over ten minutes at
    540,000 keys)."""
    return set(np.asarray(index.keys).tolist())


class VectorIndexes:
    """One index per user; keys are the vectors table's keys."""

    def __init__(
        self,
        folder: Path,
        ndim: int,
        keys_of: KeysOf,
        fetch: FetchVectors,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        self.folder = folder
        self.ndim = ndim
        self._keys_of = keys_of
        self._fetch = fetch
        self._budget = budget_bytes
        self._loaded: OrderedDict[str, AnyIndex] = OrderedDict()
        # Each loaded index's resident_bytes_of, counted as it loads and changes.
        self._sizes: dict[str, int] = {}
        self._loads: dict[str, asyncio.Task[None]] = {}
        self._dirty: set[str] = set()
        # usearch may not be searched while it grows or is saved while it changes.
        self._lock = ReadWriteLock()
        # One save at a time: two would write one index's file at once (the saver every
        # HYATLAS_STORE_SAVE_EVERY, a flush, a snapshot).
        self._saving = asyncio.Lock()
        # Numbers the files saves write before they are put in place.
        self._saves = itertools.count()

    def open(self) -> None:
        """Makes the folder and clears saves a crash cut short."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for path in self.folder.glob("*.tmp"):
            path.unlink()

    def _path(self, user_id: str) -> Path:
        return self.folder / index_file_name(user_id)

    def _restore(self, user_id: str) -> AnyIndex | None:
        path = self._path(user_id)
        if not path.exists():
            return None
        try:
            if is_flat_file(path):
                # An earlier store's save of a small index: built from SQLite like any now.
                path.unlink()
                return None
            index = read_index_file(path)
        except Exception:
            log.warning("vector index %s is unreadable; rebuilding it", path, exc_info=True)
            return None
        if index is None or index.ndim != self.ndim:
            log.warning("vector index %s has the wrong shape; rebuilding it", path)
            return None
        if index.dtype != PRECISION:
            log.info("vector index %s holds %s vectors; rebuilding it at %s", path,
                     index.dtype.name, PRECISION.name)
            return None
        return index

    async def _load(self, user_id: str) -> None:
        """Opens a user's index and brings it level with the keys SQLite holds (writer held)."""
        index = await asyncio.to_thread(self._restore, user_id)
        want = await self._keys_of(user_id)
        if index is None:
            index = empty_index(self.ndim, len(want))
        have = await asyncio.to_thread(_keys_in, index)
        stale = sorted(have - want)
        missing = sorted(want - have)
        if stale:
            await asyncio.to_thread(index.remove, stale)
        if missing:
            vectors = await self._fetch(missing)
            await asyncio.to_thread(index.add, np.array(missing, dtype=np.uint64), vectors)
        # A flat index is built from SQLite at each load: nothing to catch up or save.
        if (stale or missing) and not isinstance(index, FlatIndex):
            log.info(
                "vector index %s caught up: %d added, %d removed",
                index_file_name(user_id),
                len(missing),
                len(stale),
            )
            self._dirty.add(user_id)
        self._loaded[user_id] = index if fits(index) else await asyncio.to_thread(fitting, index)
        self._measure(user_id)
        await self._evict(keep=user_id)

    def _measure(self, user_id: str) -> None:
        """Counts a loaded index's size anew (after it was loaded or changed)."""
        self._sizes[user_id] = resident_bytes_of(self._loaded[user_id])

    async def _evict(self, keep: str) -> None:
        """Drops the least recently used indexes beyond the budget, a usearch one saved first
        (writer held)."""
        while self.resident_bytes > self._budget and len(self._loaded) > 1:
            user_id = next(iter(self._loaded))
            if user_id == keep:
                self._loaded.move_to_end(user_id)
                continue
            await self._save_one(user_id)
            del self._loaded[user_id]
            del self._sizes[user_id]

    async def _ensure_loaded(self, user_id: str) -> None:
        """Loads a user's index in a task of its own, shared by every caller meanwhile: a caller
        that gives up (a search past its deadline) leaves the load to finish, so a large index
        built from SQLite is not started over by each search."""
        if user_id in self._loaded:
            return
        task = self._loads.get(user_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load_when_free(user_id))
            self._loads[user_id] = task
            task.add_done_callback(lambda done: self._load_ended(user_id, done))
        await asyncio.shield(task)

    async def _load_when_free(self, user_id: str) -> None:
        async with self._lock.writing():
            if user_id not in self._loaded:
                await self._load(user_id)

    def _load_ended(self, user_id: str, task: asyncio.Task[None]) -> None:
        self._loads.pop(user_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.warning("vector index of %s could not be loaded: %s", index_file_name(user_id),
                        task.exception())

    @contextlib.asynccontextmanager
    async def _reading(self, user_id: str) -> AsyncIterator[AnyIndex]:
        """A user's index, loaded if it is not, held for reading."""
        while True:
            await self._ensure_loaded(user_id)
            async with self._lock.reading():
                index = self._loaded.get(user_id)
                if index is None:
                    continue  # evicted between the load and the read: load it again
                self._loaded.move_to_end(user_id)
                yield index
                return

    async def apply(self, changes: IndexChanges) -> None:
        """Removes and adds the keys of one committed write. An index that is not loaded is
        loaded (from its file, caught up with SQLite, this write included), so no search ever
        has to build a whole index. Keys the index holds already (a load that read this write)
        are not added again. The write is committed: a caller that gives up (its deadline
        passed) leaves this to finish, so a load that read the keys before the write committed
        does not leave its keys out."""
        await asyncio.shield(self._apply(changes))

    async def _apply(self, changes: IndexChanges) -> None:
        users = list(dict.fromkeys([*changes.removed, *changes.added]))
        for user_id in users:
            await self._ensure_loaded(user_id)
        async with self._lock.writing():
            for user_id in users:
                index = self._loaded.get(user_id)
                if index is None:  # evicted since: loading it catches up with this write
                    await self._load(user_id)
                    continue
                removed = changes.removed.get(user_id)
                if removed:
                    await asyncio.to_thread(index.remove, removed)
                added = [(k, v) for k, v in changes.added.get(user_id, []) if k not in index]
                if added:
                    # On one thread unless every_core: a write's keys are added while the
                    # embedder runs the next texts on the cores (an import embeds ahead), and
                    # usearch's thread per core took them from it.
                    await asyncio.to_thread(
                        functools.partial(index.add, threads=0 if changes.every_core else 1),
                        np.array([key for key, _ in added], dtype=np.uint64),
                        as_stored(np.stack([vector for _, vector in added])),
                    )
                if not fits(index):
                    self._loaded[user_id] = await asyncio.to_thread(fitting, index)
                self._dirty.add(user_id)
                self._measure(user_id)
                self._loaded.move_to_end(user_id)

    @contextlib.asynccontextmanager
    async def switching(self, ndim: int) -> AsyncIterator[None]:
        """Held while the index folder is replaced by one of another model: every loaded index
        is dropped unsaved, and searches wait until the new folder is in place."""
        # After any save under way: a child writing an index of the old model must not put its
        # file in the new folder.
        async with self._saving, self._lock.writing():
            self._loaded.clear()
            self._sizes.clear()
            self._dirty.clear()
            self.ndim = ndim
            yield

    @property
    def resident_bytes(self) -> int:
        """About how much memory the loaded indexes take (resident_bytes_of each)."""
        return sum(self._sizes.values())

    @property
    def total(self) -> int:
        """How many vectors the loaded indexes hold."""
        return sum(len(index) for index in self._loaded.values())

    @property
    def dirty(self) -> bool:
        """Whether an index changed since it was last saved."""
        return bool(self._dirty)

    async def search(
        self, user_id: str, vector: np.ndarray, count: int, exact_up_to: int
    ) -> Matches:
        """The nearest keys in a user's index (brute force up to exact_up_to vectors)."""
        async with self._reading(user_id) as index:
            if vector.shape != (self.ndim,):  # a re-embed switched models since it was checked
                raise Conflict(f"the store's vectors have {self.ndim} dimensions now: search again")
            size = len(index)
            if size == 0:
                empty = np.zeros(0, dtype=np.uint64)
                return Matches(empty, np.zeros(0, dtype=np.float32), 0)
            search = functools.partial(
                index.search, vector, min(count, size), exact=size <= exact_up_to
            )
            # A search of the usual breadth takes under a millisecond (the 200 nearest of random
            # unit vectors, in-process: exact among 20,000 0.75 ms, approximate among 100,000
            # 0.59): run here, it saves a thread's hand-off.
            matches = search() if count <= QUICK_SEARCH_KEYS else await asyncio.to_thread(search)
        scores = 1.0 - np.asarray(matches.distances, dtype=np.float32)
        return Matches(np.asarray(matches.keys), scores, size)

    async def vectors(self, user_id: str, keys: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """The vectors of the given keys that a user's index holds, with their keys."""
        if not keys:
            return [], np.zeros((0, self.ndim), dtype=np.float32)
        async with self._reading(user_id) as index:
            got = await asyncio.to_thread(
                index.get, np.array(keys, dtype=np.uint64), dtype="f32"
            )
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
        """Writes every changed index to disk (atomically); searches go on meanwhile. A caller
        that gives up (a flush past its deadline, the periodic saver stopped) leaves the save
        to finish: its thread would go on writing the file the next save writes too."""
        return await asyncio.shield(self._save())

    async def _save(self) -> int:
        async with self._saving:
            for user_id in sorted(self._dirty):
                await self._save_unheld(user_id)
            return self.total

    async def _save_unheld(self, user_id: str) -> None:
        """Saves one index, holding the lock as briefly as it can: a write or a load waiting
        meanwhile goes between two indexes (100,000 small owners' saves, a file and two syncs
        each, held it for seconds), and a large index is held only until a forked child has its
        image (one owner's 100,000 memories and their sentence keys, 149 MB, took 0.3 s to write
        and sync on this machine's disk, longer on a slow one, and writes waited for it)."""
        async with self._lock.reading(saving=True):
            index = self._loaded.get(user_id)
            if user_id not in self._dirty or index is None:
                return
            if isinstance(index, FlatIndex):
                await self._save_one(user_id)
                return
            path = self._path(user_id)
            # Its own name: an eviction may save this index too while the child writes.
            tmp = path.with_name(f"{path.stem}.{next(self._saves)}.tmp")
            detached = await asyncio.to_thread(begin_save, index, str(tmp)) if len(index) else None
            if detached is None:
                await self._save_one(user_id)
                return
            self._dirty.discard(user_id)  # a write from here on marks it again
        try:
            failure = await asyncio.to_thread(detached.failure)
            if not failure:
                # An eviction may have saved a newer image meanwhile: whichever lands last, a
                # load catches the index up with SQLite.
                await asyncio.to_thread(put_in_place, tmp, path)
                return
        except BaseException:
            self._dirty.add(user_id)
            raise
        log.warning("the forked save of %s failed (%s); saving it again holding the lock",
                    path.name, failure)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        self._dirty.add(user_id)
        async with self._lock.reading(saving=True):
            await self._save_one(user_id)

    async def _save_one(self, user_id: str) -> None:
        """Saves one index here and now (the caller holds the lock)."""
        index = self._loaded.get(user_id)
        if user_id not in self._dirty or index is None:
            return
        path = self._path(user_id)
        if len(index) == 0 or isinstance(index, FlatIndex):
            # Nothing to keep: a small index is built from SQLite when it is loaded (a file
            # left from when it was larger goes).
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        else:
            tmp = path.with_suffix(".tmp")
            try:
                await asyncio.to_thread(save_index, index, str(tmp))
            except RuntimeError as exc:
                raise _unsaved(index, tmp) from exc
            await asyncio.to_thread(put_in_place, tmp, path)
        self._dirty.discard(user_id)


def _unsaved(index: AnyIndex, tmp: Path) -> OSError | RuntimeError:
    """Removes what a failed save wrote (it would hold the disk's last free bytes), and says
    why it failed: usearch says only "Failed to serialize into stream", also for a full disk."""
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    if shutil.disk_usage(tmp.parent).free < index.serialized_length:
        return OSError(errno.ENOSPC, f"no room for the vector index {tmp.stem}")
    return RuntimeError(f"could not save the vector index {tmp.stem}")


def read_index_file(path: Path) -> Index | None:
    """The usearch index saved at path (None: no usearch index there)."""
    return Index.restore(str(path))


def write_index_file(path: Path, ndim: int, keys: np.ndarray, vectors: np.ndarray) -> None:
    """Saves a usearch index of the given keys and vectors at path (for a folder not in use);
    no more of them than a flat index holds are written anywhere: loaded, such an index is
    built from SQLite."""
    if len(keys) <= FLAT_UP_TO:
        return
    index = new_index(ndim)
    index.add(keys.astype(np.uint64), vectors.astype(np.float32))
    index.save(str(path))
    synced(path)
