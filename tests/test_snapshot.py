"""Snapshots: taken under concurrent writes they are whole, and restoring one brings it all back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sqlite3
import uuid
import zipfile
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.store import snapshot
from services.store.disk_reserve import RESERVE_NAME
from shared.snapshot_names import snapshot_name
from tests.store_state import call, observed, seed
from tests.support import Stack, assert_eventually, running_stack

pytestmark = pytest.mark.slow

SERVICES = ["store", "search", "gateway"]


async def _write_until(stack: Stack, user: str, stop: asyncio.Event, acked: list[str]) -> None:
    """Adds rows one after another until told to stop; acked lists the acknowledged ids."""
    while not stop.is_set():
        status, body = await call(
            stack, "POST", "/api/v1/add",
            json={"text": f"Concurrent note number {len(acked)}", "user_id": user},
        )
        assert status == 200, body
        acked.append(body["memory_id"])


def _restore(snapshot: Path, data_dir: Path) -> None:
    """The README's restore: replace the data directory with the snapshot's contents."""
    shutil.rmtree(data_dir)
    data_dir.mkdir()
    with zipfile.ZipFile(snapshot) as archive:
        archive.extractall(data_dir)


def _opened(snapshot: Path, size: int, into: Path, user: str) -> list[str]:
    """Unzips a snapshot, checks it is whole, and returns the user's rows in it, oldest first
    (a small user's vector index is not in it: built from SQLite when loaded, as the restored
    store's searches show)."""
    assert snapshot.stat().st_size == size
    with zipfile.ZipFile(snapshot) as archive:
        archive.extractall(into)
        assert not [name for name in archive.namelist() if name.startswith("run/")]
        assert RESERVE_NAME not in archive.namelist()  # room, not data
    with contextlib.closing(sqlite3.connect(into / "hyatlas.db")) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        rows = db.execute("SELECT id FROM memories WHERE user_id = ? ORDER BY seq", (user,))
        return [r[0] for r in rows]


async def test_a_snapshot_under_writes_is_whole_and_restoring_it_brings_back_that_state(
    tmp_path: Path, embedder_address: str
) -> None:
    data_dir, folder = tmp_path / "data", tmp_path / "snapshots"
    user, busy = f"user-{uuid.uuid4().hex[:8]}", f"busy-{uuid.uuid4().hex[:8]}"
    with running_stack(
        data_dir, SERVICES, HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_ADMIN="on",
        HYATLAS_SNAPSHOT_DIR=str(folder),
    ) as stack:
        await seed(stack, user)
        before = await observed(stack, user)
        stop, acked = asyncio.Event(), []
        writer = asyncio.create_task(_write_until(stack, busy, stop, acked))
        await assert_eventually(lambda: len(acked) >= 3)
        acked_before = len(acked)
        status, taken = await call(stack, "POST", "/api/v1/admin/snapshot")
        acked_after = len(acked)
        await assert_eventually(lambda: len(acked) >= acked_after + 3)
        stop.set()
        await writer
        assert status == 200, taken
        snapshot = Path(taken["path"])
        assert snapshot.parent == folder and snapshot.name.startswith("hyatlas-")
        assert taken["paused_s"] >= 0
        kept = _opened(snapshot, taken["bytes"], tmp_path / "opened", busy)
        # Every write acknowledged before the snapshot began is in it, in order, and none made
        # after it ended (one write may have been in flight while its reply came back).
        assert acked_before <= len(kept) <= acked_after + 1 and kept == acked[: len(kept)]

        # Changes after the snapshot, which the restore must undo.
        await call(stack, "POST", "/api/v1/add", json={"text": "Written later.", "user_id": user})
        assert await observed(stack, user) != before

        stack.stop_all()
        _restore(snapshot, data_dir)
        for service in SERVICES:
            stack.start(service)
        assert await observed(stack, user) == before
        status, listing = await call(
            stack, "POST", "/api/v1/list", json={"user_id": busy, "limit": 1000}
        )
        assert [m["memory_id"] for m in listing["memories"]][::-1] == kept


async def test_snapshots_follow_the_schedule_and_only_the_newest_are_kept(
    tmp_path: Path, embedder_address: str
) -> None:
    folder = tmp_path / "snapshots"
    seen: set[str] = set()

    def kept_two_of_three() -> None:
        now = {path.name for path in folder.glob("hyatlas-*.zip")}
        seen.update(now)
        assert len(seen) >= 3 and len(now) == 2

    with running_stack(
        tmp_path / "data", ["store"], HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_SNAPSHOT_DIR=str(folder), HYATLAS_SNAPSHOT_EVERY="1s", HYATLAS_SNAPSHOT_KEEP="2",
    ):
        await assert_eventually(kept_two_of_three, interval_s=0.02)
    now = {path.name for path in folder.glob("hyatlas-*.zip")}
    assert sorted(seen | now)[-2:] == sorted(now)  # the newest two, however many came before


def test_a_restart_waits_for_the_newest_snapshot_to_be_an_interval_old(tmp_path: Path) -> None:
    # Seven restarts in an hour each took a snapshot a minute after start, and with
    # HYATLAS_SNAPSHOT_KEEP 7 rotated out every snapshot from before them.
    day, now = 86400.0, 1796600000.0
    assert snapshot.first_pause_s(tmp_path / "none", day, now) == snapshot.FIRST_AFTER_S
    (tmp_path / snapshot_name(datetime.fromtimestamp(now - 2 * day, UTC))).touch()
    (tmp_path / "hyatlas-before-upgrade.zip").touch()  # not one of the store's
    assert snapshot.first_pause_s(tmp_path, day, now) == snapshot.FIRST_AFTER_S
    (tmp_path / snapshot_name(datetime.fromtimestamp(now - 3600, UTC))).touch()
    assert snapshot.first_pause_s(tmp_path, day, now) == pytest.approx(day - 3600)
    assert snapshot.first_pause_s(tmp_path, 30.0, now) == 30.0  # an interval under a minute


def test_a_file_gone_between_listing_and_copying_is_left_out_of_the_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, staging = tmp_path / "data", tmp_path / "staging"
    (data / "vectors").mkdir(parents=True)
    staging.mkdir()
    sqlite3.connect(data / snapshot.DB_NAME).close()
    (data / "vectors" / "alice.usearch").write_bytes(b"kept")
    (data / "vectors" / "bob.usearch").write_bytes(b"let go of while the copy runs")
    copy2 = shutil.copy2

    def copy_once_bob_is_gone(source: Path, target: Path) -> object:
        if source.name == "bob.usearch":
            source.unlink()  # after the listing and the check that it is a file
        return copy2(source, target)

    monkeypatch.setattr(snapshot.shutil, "copy2", copy_once_bob_is_gone)
    snapshot._copy(data, staging, ())
    assert (staging / "vectors" / "alice.usearch").read_bytes() == b"kept"
    assert not (staging / "vectors" / "bob.usearch").exists()



async def test_only_files_named_as_the_store_names_snapshots_are_listed_and_pruned(
    tmp_path: Path, embedder_address: str
) -> None:
    folder = tmp_path / "snapshots"
    folder.mkdir()
    # A user's own zips beside the snapshots, one of them sorting before every timestamp.
    own = ["hyatlas-before-upgrade.zip", "hyatlas-0-first.zip", "hyatlas-20261201.zip"]
    for name in own:
        (folder / name).write_bytes(b"the user's own")
    with running_stack(
        tmp_path / "data", ["store", "gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_ADMIN="on", HYATLAS_SNAPSHOT_DIR=str(folder), HYATLAS_SNAPSHOT_KEEP="2",
    ) as stack:
        taken = []
        for _ in range(3):
            status, body = await call(stack, "POST", "/api/v1/admin/snapshot")
            assert status == 200, body
            taken.append(Path(body["path"]).name)
        status, system = await call(stack, "GET", "/dashboard/api/system")
    assert status == 200, system
    assert sorted(file["name"] for file in system["snapshots"]["files"]) == taken[1:]
    assert sorted(path.name for path in folder.iterdir()) == sorted(own + taken[1:])


def _leave_leftovers(folder: Path) -> list[Path]:
    """What a store killed mid-snapshot leaves: its staging copy, or its zip half written."""
    staging = folder / ".staging-k1ll3d"
    (staging / "vectors").mkdir(parents=True)
    (staging / "hyatlas.db").write_bytes(b"a whole copy of the database")
    partial = folder / "hyatlas-20261201T030000.000000Z.zip.partial"
    partial.write_bytes(b"half a zip")
    return [staging, partial]


async def test_what_a_snapshot_killed_midway_left_is_removed_at_start_and_before_the_next(
    tmp_path: Path, embedder_address: str
) -> None:
    folder = tmp_path / "snapshots"
    left = _leave_leftovers(folder)
    with running_stack(
        tmp_path / "data", ["store", "gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_ADMIN="on", HYATLAS_SNAPSHOT_DIR=str(folder),
    ) as stack:
        assert not [path for path in left if path.exists()]
        _leave_leftovers(folder)
        status, taken = await call(stack, "POST", "/api/v1/admin/snapshot")
    assert status == 200, taken
    assert [path.name for path in folder.iterdir()] == [Path(taken["path"]).name]


class _Stop(BaseException):
    """Ends a schedule under test: no `except Exception` of it catches this."""


async def test_a_failed_scheduled_snapshot_is_tried_again_sooner_and_said_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Five copies refused by a full disk, one that works, one unexpected error: the pauses
    between tries grow from five minutes up to the interval, and the failure is kept for stats
    until a snapshot is written."""
    (tmp_path / "data").mkdir()
    core = SimpleNamespace(write_lock=asyncio.Lock(), indexes=None)
    plan = snapshot.SnapshotPlan(tmp_path / "snapshots", every_s=3600.0)
    snaps = snapshot.Snapshots(core, tmp_path / "data", plan)  # type: ignore[arg-type]
    outcomes: list[BaseException | None] = [
        *[sqlite3.OperationalError("database or disk is full")] * 5,
        None, RuntimeError("something unexpected"), _Stop(),
    ]
    failures_seen: list[snapshot.SnapshotFailure | None] = []

    def copy(data_dir: Path, staging: Path, skip: tuple[Path, ...]) -> None:
        failures_seen.append(getattr(snaps, "last_failure", None))
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    pauses: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay_s: float) -> None:  # the schedule's pauses, not waited out
        pauses.append(delay_s)
        if len(pauses) > len(failures_seen) + 1:  # a failure the schedule took for a copy's
            raise _Stop
        await real_sleep(0)

    monkeypatch.setattr(snapshot, "_copy", copy)
    monkeypatch.setattr(snapshot.asyncio, "sleep", sleep)
    with caplog.at_level(logging.INFO, logger=snapshot.__name__), pytest.raises(_Stop):
        await snaps.run_schedule()

    assert pauses == [60, 300, 600, 1200, 2400, 3600, 3600, 300]
    assert failures_seen[0] is None
    for seen, pause_s in zip(failures_seen[1:6], pauses[1:6], strict=True):
        assert seen is not None and seen.reason == "the disk is full"
        assert seen.retry_at - seen.at == pytest.approx(pause_s)
    assert failures_seen[6] is None  # the snapshot written cleared it
    assert snaps.last_failure is not None
    assert snaps.last_failure.reason == "RuntimeError (the store's log has the details)"
    failed = [r for r in caplog.records if "snapshot failed" in r.getMessage()]
    assert [(r.levelno, r.exc_info is None) for r in failed] == [
        *[(logging.WARNING, True)] * 5, (logging.ERROR, False)
    ]
    assert failed[0].getMessage() == (
        "snapshot failed, the disk is full (database or disk is full); will try again in 300s"
    )
    assert len(list(plan.folder.glob("hyatlas-*.zip"))) == 1
