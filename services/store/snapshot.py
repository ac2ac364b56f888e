"""Snapshots: a consistent copy of the data directory, zipped, the newest few kept."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sqlite3
import tempfile
import time
import zipfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from services.store.core import Core
from services.store.disk_full import disk_full
from services.store.disk_reserve import RESERVE_NAME
from services.store.durable import put_in_place
from services.store.text_index import KEYWORDS_FOLDER
from shared.snapshot_names import is_snapshot_name, snapshot_name, snapshot_time

log = logging.getLogger(__name__)

DB_NAME = "hyatlas.db"
# A snapshot is copied into a staging folder, then zipped into a partial file renamed into place.
STAGING_PREFIX = ".staging-"
PARTIAL_SUFFIX = ".partial"
# The first scheduled snapshot comes this long after start (sooner if the interval is shorter),
# or once the newest snapshot in the folder is an interval old if that is later.
FIRST_AFTER_S = 60.0
# A scheduled snapshot that failed is tried again after this long, then twice as long after
# each failure in a row, never later than the regular interval.
RETRY_FIRST_S = 300.0


@dataclass(frozen=True)
class SnapshotPlan:
    """Where snapshots go, how many are kept, how often one is taken, and what is left out."""

    folder: Path
    keep: int = 7
    every_s: float | None = None
    skip: tuple[Path, ...] = ()
    """Folders under the data directory that are no data (the sockets, snapshots put inside)."""


@dataclass(frozen=True)
class SnapshotFailure:
    """The last scheduled snapshot failed: when (unix seconds), why, and when it is tried again."""

    at: float
    reason: str
    retry_at: float


@dataclass(frozen=True)
class Snapshot:
    """One snapshot written: its file, its size and how long writes waited for the copy."""

    path: Path
    size_bytes: int
    paused_s: float


def _copy(data_dir: Path, staging: Path, skip: tuple[Path, ...]) -> None:
    """The database through SQLite's online backup, and every other data file as it is but
    the keyword indexes."""
    with (
        contextlib.closing(sqlite3.connect(data_dir / DB_NAME)) as source,
        contextlib.closing(sqlite3.connect(staging / DB_NAME)) as copy,
    ):
        source.backup(copy)
    for path in sorted(data_dir.rglob("*")):
        relative = path.relative_to(data_dir)
        if (
            not path.is_file()
            or (relative.parent == Path(".") and relative.name.startswith(DB_NAME))
            or path.suffix == ".tmp"
            or relative == Path(RESERVE_NAME)
            # Written beside searches, so a copy could be torn; rebuilt from the rows instead.
            or relative.parts[0] == KEYWORDS_FOLDER
            or any(path.is_relative_to(folder) for folder in skip)
        ):
            continue
        (staging / relative).parent.mkdir(parents=True, exist_ok=True)
        # Gone since it was listed: an empty vector index let go of, or the unfinished index
        # folder of a re-embed begun again. Neither belongs in a snapshot.
        with contextlib.suppress(FileNotFoundError):
            shutil.copy2(path, staging / relative)


def _zip(staging: Path, path: Path) -> None:
    """Zips the staging folder's contents (no folder of its own) and renames it into place;
    a zip that fails (a full disk) is removed, not left holding the space till the next one."""
    partial = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
            for file in sorted(staging.rglob("*")):
                if file.is_file():
                    archive.write(file, file.relative_to(staging).as_posix())
        put_in_place(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _prune(folder: Path, keep: int) -> list[Path]:
    """Deletes all but the newest keep snapshots; returns the deleted."""
    old = sorted(path for path in folder.iterdir() if is_snapshot_name(path.name))[:-keep]
    for path in old:
        path.unlink()
    return old


def _is_leftover(path: Path) -> bool:
    """A staging folder or an unfinished zip: only a snapshot stopped midway leaves one."""
    name = path.name
    return name.startswith(STAGING_PREFIX) or (
        name.endswith(PARTIAL_SUFFIX) and is_snapshot_name(name.removesuffix(PARTIAL_SUFFIX))
    )


def clear_leftovers(folder: Path) -> None:
    """Removes what snapshots of a store killed midway left in folder."""
    if not folder.is_dir():
        return
    left = [path for path in folder.iterdir() if _is_leftover(path)]
    for path in left:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    if left:
        log.warning("removed %d leftovers of unfinished snapshots in %s", len(left), folder)


def first_pause_s(folder: Path, every_s: float, now: float) -> float:
    """How long a starting schedule waits for its first snapshot: FIRST_AFTER_S (at most an
    interval), or till the newest snapshot is an interval old, so that restarts do not take a
    snapshot each and rotate the older ones out (HYATLAS_SNAPSHOT_KEEP)."""
    soon = min(FIRST_AFTER_S, every_s)
    names = [path.name for path in folder.iterdir()] if folder.is_dir() else []
    taken = [snapshot_time(name).timestamp() for name in names if is_snapshot_name(name)]
    return max(soon, max(taken) + every_s - now) if taken else soon


def retry_pause_s(failures: int, every_s: float) -> float:
    """How long the schedule waits after its failures-th failure in a row: RETRY_FIRST_S,
    doubled each time, at most every_s."""
    return min(RETRY_FIRST_S * 2.0 ** min(failures - 1, 32), every_s)


class Snapshots:
    """Takes snapshots of one store's data directory, one at a time."""

    def __init__(self, core: Core, data_dir: Path, plan: SnapshotPlan) -> None:
        self._core = core
        self._data_dir = data_dir
        self.plan = plan
        self._lock = asyncio.Lock()
        self.last_failure: SnapshotFailure | None = None
        """Set while the last scheduled snapshot failed; any snapshot written clears it."""

    async def take(self) -> Snapshot:
        """Copies the data while writes wait, then zips the copy and drops the oldest."""
        folder = self.plan.folder
        async with self._lock:
            folder.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(clear_leftovers, folder)
            staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=folder))
            try:
                async with self._core.write_lock:
                    start = time.monotonic()
                    if self._core.indexes is not None:
                        await self._core.indexes.save()
                    await asyncio.to_thread(_copy, self._data_dir, staging, self.plan.skip)
                    paused_s = time.monotonic() - start
                path = folder / snapshot_name(datetime.now(UTC))
                await asyncio.to_thread(_zip, staging, path)
            finally:
                await asyncio.to_thread(shutil.rmtree, staging, True)
            dropped = await asyncio.to_thread(_prune, folder, self.plan.keep)
            self.last_failure = None
        size = path.stat().st_size
        log.info(
            "snapshot %s written (%d bytes, writes paused %.3fs, %d old ones deleted)",
            path, size, paused_s, len(dropped),
        )
        return Snapshot(path, size, paused_s)

    async def run_schedule(self) -> None:
        """Takes a snapshot every plan.every_s seconds, the first one a minute after start or
        an interval after the newest one (first_pause_s); one that failed is tried again sooner
        (retry_pause_s)."""
        every_s = self.plan.every_s
        if not every_s:
            return
        await asyncio.sleep(
            await asyncio.to_thread(first_pause_s, self.plan.folder, every_s, time.time())
        )
        failures = 0
        while True:
            try:
                await self.take()
                failures, pause_s = 0, every_s
            except Exception as exc:
                failures += 1
                pause_s = retry_pause_s(failures, every_s)
                self._failed(exc, pause_s)
            await asyncio.sleep(pause_s)

    def _failed(self, exc: Exception, pause_s: float) -> None:
        """Logs a failed scheduled snapshot (a full disk in one line, anything else with its
        traceback) and keeps it for the store's stats."""
        now = time.time()
        if disk_full(exc):
            reason = "the disk is full"
            log.warning("snapshot failed, the disk is full (%s); will try again in %.0fs",
                        exc, pause_s)
        else:
            reason = f"{_what_failed(exc)} (the store's log has the details)"
            log.exception("snapshot failed; will try again in %.0fs", pause_s)
        self.last_failure = SnapshotFailure(now, reason, now + pause_s)


def _what_failed(exc: Exception) -> str:
    """A failure in a few words: an OSError's words and the path it names (a folder that is a
    file, a folder it may not write), else the exception's kind."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return type(exc).__name__
