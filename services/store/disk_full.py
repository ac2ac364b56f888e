"""Telling a full disk apart from other storage failures, and saying so to the caller."""

from __future__ import annotations

import contextlib
import errno
import sqlite3
from collections.abc import Iterator

from shared.errors import StorageFull

# How tantivy (ValueError) and the OS word a full disk; SQLite says "database or disk is full".
# A tantivy writer whose thread met the full disk says only that it was killed.
_WORDS = (
    "disk is full",
    "StorageFull",
    "No space left on device",
    "Disk quota exceeded",
    "A worker thread encountered an error (io::Error",
)


def disk_full(exc: BaseException) -> bool:
    """Whether exc (or what caused it) is a write refused because the disk has no room."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, (sqlite3.Error, ValueError, RuntimeError)) and any(
            word in str(exc) for word in _WORDS
        ):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


@contextlib.contextmanager
def full_disk_refused(what: str) -> Iterator[None]:
    """Raises StorageFull for a full disk met in the block, naming what was not done."""
    try:
        yield
    except Exception as exc:
        if not disk_full(exc):
            raise
        raise StorageFull(
            f"the data directory's disk is full: {what}; free some space and send it again"
        ) from exc
