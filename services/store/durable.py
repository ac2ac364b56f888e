"""Putting a written file or folder in place so that a power loss leaves under its name the old
one or the whole new one, never an empty or torn one."""

from __future__ import annotations

import os
from pathlib import Path


def synced(path: Path) -> None:
    """Flushes a file's data, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def put_in_place(written: Path, path: Path) -> None:
    """Renames written (a file, or a folder whose files are synced) to path, atomically and
    durably: its content is on the disk before the rename, and the rename before this returns.

    A rename alone is atomic but promises nothing of the renamed file's data: after a power loss
    the new name may hold an empty or torn file.
    """
    synced(written)
    os.replace(written, path)
    synced(path.parent)
