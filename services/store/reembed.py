"""Re-embedding: every vector made again with the embedder's configured model while searches
use the old ones, then one switch (the rows in one transaction, the index folder swapped).

Progress lives in SQLite: the new vectors wait in reembed_vectors and reembed_keys, and a
cursor (the last row sequence staged in the first pass) is committed with each batch, so a
rebuild killed midway goes on where it stopped. Rows written during the rebuild get vectors of
the old model, like any write; sweeps over rows whose new vector is missing or was made from an
older text catch them up, the last one under the write lock, in the switch's transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from services.store.core import Core, VectorModel
from services.store.durable import put_in_place, synced
from services.store.index import VectorIndexes, index_file_name, write_index_file
from services.store.repo import CLAUSE_KEY_OFFSET, Repo, unblob, vector_blob
from shared.clients import ModelInfo
from shared.errors import Internal
from shared.passages import Passage
from shared.redact import redact_text

log = logging.getLogger(__name__)

# The index folder of a rebuild is built beside the live one, and the live one is moved aside
# while the new one takes its place; MODEL inside a folder names the model its vectors are of.
NEXT_SUFFIX = ".next"
OLD_SUFFIX = ".old"
MODEL_MARKER = "MODEL"

META_TO = "reembed_to"
META_NDIM = "reembed_ndim"
META_CURSOR = "reembed_cursor"

# Sweeps without the lock go on until one catches up at most a batch; then writes wait while
# at most this many batches are made, and the switch follows.
FINAL_SWEEPS = 3

# A memory whose new vector is missing, was made from an older text, or lacks a clause key's.
_PENDING = """
SELECT m.seq, m.id, m.content FROM memories m
LEFT JOIN reembed_vectors r ON r.memory_id = m.id
WHERE m.seq > ? AND (r.memory_id IS NULL OR r.content != m.content OR EXISTS (
  SELECT 1 FROM memory_keys mk WHERE mk.memory_id = m.id AND mk.vector IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM reembed_keys rk WHERE rk.key = mk.key)))
ORDER BY m.seq LIMIT ?
"""

_SWITCH = (
    "UPDATE vectors SET model_id = :model, vector = "
    "(SELECT r.vector FROM reembed_vectors r WHERE r.memory_id = vectors.memory_id)",
    "UPDATE memory_keys SET model_id = :model, vector = "
    "(SELECT rk.vector FROM reembed_keys rk WHERE rk.key = memory_keys.key) "
    "WHERE vector IS NOT NULL",
    "UPDATE memories SET model_id = :model WHERE model_id != :model",
)


class ModelSource(Protocol):
    """What a re-embed needs from the embedder: vectors of a named model, and the served one."""

    async def embed_passages(
        self, passages: Sequence[Passage], model_id: str = "", *, bulk: bool = False
    ) -> tuple[np.ndarray, str]: ...

    async def describe(self, model_id: str = "") -> ModelInfo: ...

    async def serve(self, model_id: str) -> ModelInfo: ...


@dataclass(frozen=True)
class ReembedPlan:
    """How a re-embed runs."""

    batch: int = 64
    """HYATLAS_REEMBED_BATCH: rows embedded in one call and staged in one transaction."""
    rows_per_s: float | None = None
    """HYATLAS_REEMBED_ROWS_PER_S: the most rows a second (None: as fast as the embedder goes),
    so a rebuild leaves the machine to live traffic."""
    watch_every_s: float = 1.0
    """How often the embedder is checked to still serve the store's model (it forgets after a
    restart)."""
    retry_s: float = 1.0
    """The first wait after a failed step (doubling up to 30 s)."""


@dataclass(frozen=True)
class Progress:
    """Where a re-embed stands."""

    to_model_id: str
    done: int
    total: int
    state: str
    error: str = ""


@dataclass(frozen=True)
class _Row:
    seq: int
    memory_id: str
    content: str
    keys: tuple[tuple[int, str], ...] = ()


@dataclass
class _Made:
    """New vectors of a batch: each memory's (with its text) and each clause key's."""

    memories: list[tuple[str, str, bytes]] = field(default_factory=list)
    keys: list[tuple[int, bytes]] = field(default_factory=list)


# -- folders ---------------------------------------------------------------------------------


def _marker(folder: Path) -> str:
    try:
        return (folder / MODEL_MARKER).read_text().strip()
    except FileNotFoundError:
        return ""


def settle_index_folders(folder: Path, model_id: str) -> None:
    """Leaves the index folder of the store's model after a crash at any point of a switch:
    a complete new folder of that model takes the live one's place, any other is removed; a
    live folder marked with another model is emptied (its indexes rebuild from SQLite)."""
    ready = folder.with_name(folder.name + NEXT_SUFFIX)
    if ready.is_dir():
        if _marker(ready) == model_id:
            swap_in(folder)
        else:
            shutil.rmtree(ready)
    _drop_aside(folder)
    live = _marker(folder) if folder.is_dir() else ""
    if live and live != model_id:
        log.warning("index folder %s holds model %s, not %s; rebuilding it", folder, live, model_id)
        shutil.rmtree(folder)


def swap_in(folder: Path) -> None:
    """Puts the built folder in the live one's place (each rename is atomic)."""
    ready = folder.with_name(folder.name + NEXT_SUFFIX)
    aside = _drop_aside(folder)
    if folder.is_dir():
        folder.rename(aside)
    put_in_place(ready, folder)
    _drop_aside(folder)


def _drop_aside(folder: Path) -> Path:
    """Removes the folder a switch moved aside (only ever left by a crash or a swap)."""
    aside = folder.with_name(folder.name + OLD_SUFFIX)
    if aside.is_dir():
        shutil.rmtree(aside)
    return aside


# -- the job's state in SQLite -----------------------------------------------------------------


async def job_target(repo: Repo) -> str:
    """The model a re-embed in progress moves to ("" when none is)."""
    return await repo.get_meta(META_TO) or ""


async def begin(repo: Repo, target: VectorModel) -> None:
    """Records a re-embed toward target; one toward another model is dropped with its work."""
    if await job_target(repo) == target.model_id:
        return
    async with repo.transaction():
        await _clear(repo)
        await repo.set_meta(META_TO, target.model_id)
        await repo.set_meta(META_NDIM, str(target.ndim))
    log.info("re-embed toward %s (%d-d) begins", target.model_id, target.ndim)


async def drop(repo: Repo) -> None:
    """Forgets a re-embed in progress and its staged vectors."""
    if not await job_target(repo):
        return
    async with repo.transaction():
        await _clear(repo)
    log.info("re-embed given up: the store's model is the configured one again")


async def _clear(repo: Repo) -> None:
    """Empties the staging tables and the job's meta (inside the caller's transaction)."""
    await repo.writer.execute("DELETE FROM reembed_vectors")
    await repo.writer.execute("DELETE FROM reembed_keys")
    await repo.writer.execute(
        "DELETE FROM store_meta WHERE key IN (?, ?, ?)", (META_TO, META_NDIM, META_CURSOR)
    )


async def _pending(repo: Repo, after: int, limit: int) -> list[_Row]:
    rows = await repo.reader.execute_fetchall(_PENDING, (after, limit))
    found = [_Row(int(r[0]), str(r[1]), str(r[2])) for r in rows]
    if not found:
        return []
    keys = await repo.reader.execute_fetchall(
        "SELECT key, memory_id, text FROM memory_keys WHERE vector IS NOT NULL "
        "AND memory_id IN (SELECT value FROM json_each(?)) ORDER BY key",
        (json.dumps([row.memory_id for row in found]),),
    )
    by_memory: dict[str, list[tuple[int, str]]] = {}
    for key, memory_id, text in keys:
        by_memory.setdefault(memory_id, []).append((int(key), str(text)))
    return [
        _Row(row.seq, row.memory_id, row.content, tuple(by_memory.get(row.memory_id, ())))
        for row in found
    ]


async def _counts(repo: Repo) -> tuple[int, int]:
    rows = await repo.reader.execute_fetchall(
        "SELECT (SELECT count(*) FROM reembed_vectors r JOIN memories m "
        "ON m.id = r.memory_id AND m.content = r.content), (SELECT count(*) FROM memories)"
    )
    done, total = next(iter(rows))
    return int(done), int(total)


async def _staged_of(repo: Repo, user_id: str, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """A user's index keys and their new vectors, for those made from the current text."""
    own = await repo.reader.execute_fetchall(
        "SELECT v.key, r.vector FROM memories m CROSS JOIN vectors v ON v.memory_id = m.id "
        "JOIN reembed_vectors r ON r.memory_id = m.id AND r.content = m.content "
        "WHERE m.user_id = ?",
        (user_id,),
    )
    clause = await repo.reader.execute_fetchall(
        "SELECT mk.key, rk.vector FROM memories m CROSS JOIN memory_keys mk "
        "ON mk.memory_id = m.id JOIN reembed_keys rk ON rk.key = mk.key WHERE m.user_id = ?",
        (user_id,),
    )
    keys = [int(k) for k, _ in own] + [CLAUSE_KEY_OFFSET + int(k) for k, _ in clause]
    if not keys:
        return np.zeros(0, dtype=np.uint64), np.zeros((0, ndim), dtype=np.float32)
    vectors = np.stack([unblob(blob) for _, blob in [*own, *clause]])
    return np.array(keys, dtype=np.uint64), vectors


# -- the job ---------------------------------------------------------------------------------


def _passages(rows: Sequence[_Row]) -> tuple[list[Passage], list[list[int]]]:
    """Each row's text with its clause keys as spans (a key not found in the text is embedded
    on its own, after them), and for each row the keys in the order their vectors come."""
    passages: list[Passage] = []
    loose: list[Passage] = []
    order: list[list[int]] = []
    loose_keys: list[int] = []
    for row in rows:
        spans, keys = [], []
        for key, text in row.keys:
            start = row.content.find(text) if text else -1
            if start < 0:
                loose.append(Passage(text))
                loose_keys.append(key)
                continue
            spans.append((start, start + len(text)))
            keys.append(key)
        passages.append(Passage(row.content, tuple(spans)))
        order.append(keys)
    return passages + loose, [*order, loose_keys]


class Reembedder:
    """Moves the store's vectors to the target model, then switches the store over."""

    def __init__(
        self,
        core: Core,
        embedder: ModelSource,
        folder: Path,
        target: VectorModel,
        plan: ReembedPlan,
    ) -> None:
        self._core = core
        self._embedder = embedder
        self._folder = folder
        self.target = target
        self._plan = plan
        self.state = "running"
        self.error = ""

    async def progress(self) -> Progress | None:
        """Where the rebuild stands; None once the store runs the target model."""
        if self.state == "done":
            return None
        done, total = await _counts(self._core.sqlite("a re-embed"))
        if self.state == "switching":
            # Every row has its new vector by now, and the switch empties the staging tables
            # they were counted in: done stays where it got to (a progress bar never goes back).
            done = total
        return Progress(self.target.model_id, done, total, self.state, self.error)

    async def run(self) -> None:
        """Rebuilds until switched; a failed step (the embedder away) is retried."""
        wait_s = self._plan.retry_s
        async with self._watching():
            while True:
                try:
                    await self._rebuild()
                    return
                except Exception as exc:
                    # Shown by the status route: an embedder URL may carry a password.
                    self.state = "waiting"
                    self.error = redact_text(str(exc)) or type(exc).__name__
                    log.warning("re-embed paused, retrying in %.0f s: %s", wait_s, self.error)
                    await asyncio.sleep(wait_s)
                    wait_s = min(wait_s * 2, 30.0)

    @contextlib.asynccontextmanager
    async def _watching(self) -> AsyncIterator[None]:
        task = asyncio.create_task(self._keep_served(), name="re-embed served model")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _keep_served(self) -> None:
        """Tells the embedder again which model to serve when it forgot (it restarted): the
        search, extractor and consolidator embed with the served model."""
        while True:
            await asyncio.sleep(self._plan.watch_every_s)
            model = self._core.model
            if model.mismatch:
                continue
            try:
                served = await self._embedder.describe()
                if served.model_id != model.model_id:
                    await self._embedder.serve(model.model_id)
                    log.info("the embedder serves %s again", model.model_id)
            except Exception as exc:
                log.info("cannot check the embedder's model now: %s", exc)

    async def _rebuild(self) -> None:
        repo = self._core.sqlite("a re-embed")
        self.state, self.error = "running", ""
        cursor = int(await repo.get_meta(META_CURSOR) or 0)
        await self._sweep(cursor, keep_cursor=True)
        while await self._sweep(0) > self._plan.batch:
            pass
        self.state = "indexing"
        await self._build_indexes()
        self.state = "switching"
        await self._switch()
        self.state = "done"
        log.info("re-embed done: the store runs %s", self.target.model_id)

    async def _sweep(self, after: int, keep_cursor: bool = False) -> int:
        """Stages every pending row after a sequence number; returns how many."""
        staged = 0
        while rows := await _pending(self._core.sqlite("a re-embed"), after, self._plan.batch):
            started = time.monotonic()
            made = await self._embed(rows)
            async with self._core.write_lock:
                await self._stage(made, rows[-1].seq if keep_cursor else None)
            after = rows[-1].seq
            staged += len(rows)
            if self._plan.rows_per_s:
                spent_s = time.monotonic() - started
                await asyncio.sleep(max(0.0, len(rows) / self._plan.rows_per_s - spent_s))
        return staged

    async def _embed(self, rows: Sequence[_Row]) -> _Made:
        passages, order = _passages(rows)
        vectors, model_id = await self._embedder.embed_passages(
            passages, self.target.model_id, bulk=True
        )
        if model_id != self.target.model_id or vectors.shape[1:] != (self.target.ndim,):
            raise Internal(f"the embedder answered with {model_id!r}, not {self.target.model_id!r}")
        made, at = _Made(), 0
        for row, passage, keys in zip(rows, passages, order, strict=False):
            made.memories.append((row.memory_id, row.content, vector_blob(vectors[at])))
            made.keys += [(k, vector_blob(vectors[at + 1 + j])) for j, k in enumerate(keys)]
            at += passage.rows
        made.keys += [(k, vector_blob(vectors[at + j])) for j, k in enumerate(order[-1])]
        return made

    async def _stage(self, made: _Made, cursor: int | None) -> None:
        """Writes a batch's new vectors (write lock held); rows deleted meanwhile are skipped."""
        repo = self._core.sqlite("a re-embed")
        async with repo.transaction():
            await repo.writer.executemany(
                "INSERT OR REPLACE INTO reembed_vectors (memory_id, content, vector) "
                "SELECT ?, ?, ? WHERE EXISTS (SELECT 1 FROM memories WHERE id = ?)",
                [(m, c, v, m) for m, c, v in made.memories],
            )
            await repo.writer.executemany(
                "INSERT OR REPLACE INTO reembed_keys (key, vector) "
                "SELECT ?, ? WHERE EXISTS (SELECT 1 FROM memory_keys WHERE key = ?)",
                [(k, v, k) for k, v in made.keys],
            )
            if cursor is not None:
                await repo.set_meta(META_CURSOR, str(cursor))

    async def _build_indexes(self) -> None:
        """Writes every user's index of the new vectors into the folder beside the live one;
        its marker goes last, so only a complete folder is ever swapped in."""
        ready = self._folder.with_name(self._folder.name + NEXT_SUFFIX)
        await asyncio.to_thread(shutil.rmtree, ready, True)
        ready.mkdir(parents=True)
        repo, ndim = self._core.sqlite("a re-embed"), self.target.ndim
        for user_id in await repo.user_ids():
            keys, vectors = await _staged_of(repo, user_id, ndim)
            if len(keys):
                path = ready / index_file_name(user_id)
                await asyncio.to_thread(write_index_file, path, ndim, keys, vectors)
        # On the disk only after the files it vouches for (each synced as it was written).
        await asyncio.to_thread(synced, ready)
        (ready / MODEL_MARKER).write_text(self.target.model_id)
        await asyncio.to_thread(synced, ready / MODEL_MARKER)

    async def _switch(self) -> None:
        """Catches up the last rows while writes wait, then moves every row to the new
        vectors in one transaction and swaps the index folder in."""
        core, repo = self._core, self._core.sqlite("a re-embed")
        async with core.write_lock:
            for _ in range(FINAL_SWEEPS):
                rows = await _pending(repo, 0, self._plan.batch)
                if not rows:
                    break
                await self._stage(await self._embed(rows), None)
            async with repo.transaction():
                if await _pending(repo, 0, 1):
                    raise Internal("rows are still without a vector of the new model")
                for statement in _SWITCH:
                    await repo.writer.execute(statement, {"model": self.target.model_id})
                await _clear(repo)
                await repo.set_meta("model_id", self.target.model_id)
                await repo.set_meta("ndim", str(self.target.ndim))
            if isinstance(core.indexes, VectorIndexes):
                async with core.indexes.switching(self.target.ndim):
                    await asyncio.to_thread(swap_in, self._folder)
                    core.model = self.target
            else:
                await asyncio.to_thread(swap_in, self._folder)
                core.model = self.target
        try:
            await self._embedder.serve(self.target.model_id)
        except Exception as exc:
            log.warning("the embedder was not told to serve %s: %s", self.target.model_id, exc)
