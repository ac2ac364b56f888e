"""Room kept on the data disk so that a store restarted on a full disk can still open.

SQLite opens a database in WAL mode only with room for its shared-memory and log files, so on a
disk with no byte free the store could not start, and answered not a single read. While there is
room the store keeps RESERVE_BYTES in a file of its data folder, and lets it go when it opens on
a disk with less than that free: reads are answered, writes refused as on any full disk
(disk_full), and the reserve is written again once there is room (upkeep).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

from services.store.durable import put_in_place

log = logging.getLogger(__name__)

RESERVE_NAME = "disk.reserve"
RESERVE_BYTES = 512 * 1024
"""Enough for SQLite's shared-memory file (32 KiB) and the log of the few writes an opening
store makes."""
SPARE_BYTES = 4 * RESERVE_BYTES
"""What must stay free beside a new reserve: it is not to be what fills the disk."""


def release_if_full(data_dir: Path) -> bool:
    """Deletes the reserve when the disk has less than RESERVE_BYTES free; whether it did."""
    path = data_dir / RESERVE_NAME
    if not path.is_file() or shutil.disk_usage(data_dir).free >= RESERVE_BYTES:
        return False
    path.unlink()
    log.warning(
        "the data disk is full: let the %d KiB reserve go so that the store can open; writes "
        "may use that room, then are refused until space is freed (reads go on)",
        RESERVE_BYTES >> 10,
    )
    return True


def keep_reserve(data_dir: Path) -> None:
    """Writes the reserve when it is missing and the disk has room to spare for it."""
    path = data_dir / RESERVE_NAME
    if path.is_file() and path.stat().st_size >= RESERVE_BYTES:
        return
    if shutil.disk_usage(data_dir).free < RESERVE_BYTES + SPARE_BYTES:
        return
    written = path.with_name(path.name + ".tmp")
    try:
        with written.open("wb") as file:
            # Random bytes: zeros may be stored sparse or compressed, holding no room at all.
            file.write(os.urandom(RESERVE_BYTES))
        put_in_place(written, path)
    except OSError as exc:
        written.unlink(missing_ok=True)
        log.warning("could not write the data disk's reserve: %s", exc)


async def upkeep(data_dir: Path, every_s: float) -> None:
    """Writes the reserve again when it is missing and there is room, every every_s seconds
    until cancelled: a store that let it go at its start gets it back without a restart."""
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(keep_reserve, data_dir)
