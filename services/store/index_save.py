"""Writing a large vector index from a forked copy of the store, so its searches and writes go
on meanwhile.

usearch writes an index while holding Python's GIL (about 0.1 s per 100,000 half-precision
vectors), and for that long the store's event loop, and every search, stops. A forked child has a
copy-on-write image of the index and writes it while the parent only waits, in a worker thread.
The image is the index at the fork, so a lock that keeps the index still is needed until the fork
only (begin_save), not for the whole write. The child does nothing but the write and `os._exit`:
no logging, no locks, no gRPC or SQLite.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings
from typing import BinaryIO

from usearch.index import Index

log = logging.getLogger(__name__)

# Below this many bytes an in-process save stalls the loop less than a fork costs (a few ms).
DETACH_FROM_BYTES = 4 * 1024 * 1024
# A child still writing after this long is stopped, and the index is written in-process instead.
CHILD_LIMIT_S = 120.0
_POLL_S = 0.005


class Detached:
    """A save a forked child makes of the index as it was at the fork: the parent may change
    the index meanwhile (its pages are copied on write), so the lock is let go at once."""

    def __init__(self, pid: int, report: BinaryIO) -> None:
        self._pid = pid
        self._report = report

    def failure(self) -> str:
        """Waits for the child (in a thread: it sleeps between looks); why it failed, or ""."""
        with self._report:
            return _child_failure(self._pid, self._report)


def begin_save(index: Index, path: str) -> Detached | None:
    """Starts writing a large index to path from a forked child; None when the index is small
    or no child could be forked (write it here then, as save_index does)."""
    if index.serialized_length < DETACH_FROM_BYTES or not hasattr(os, "fork"):
        return None
    reading, writing = os.pipe()
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork in a threaded process; the child runs no Python
            # threads' state, only the write below.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as exc:
        os.close(reading)
        os.close(writing)
        log.warning("could not fork to save %s (%s); saving in-process", path, exc)
        return None
    if pid == 0:  # the child
        _save_and_exit(index, path, writing)
    os.close(writing)
    os.set_blocking(reading, False)  # the child's report is in the pipe by the time it ends
    return Detached(pid, os.fdopen(reading, "rb"))


def save_index(index: Index, path: str) -> None:
    """Writes index to path: from a forked child when it is large, else here (and here too
    when the child fails: its error is then the one raised)."""
    detached = begin_save(index, path)
    failure = "" if detached is None else detached.failure()
    if failure:
        log.warning("the forked save of %s failed (%s); saving in-process", path, failure)
    if detached is None or failure:
        index.save(path)


def _save_and_exit(index: Index, path: str, report: int) -> None:
    """The child's whole life: the write, then its error (if any) on the report pipe."""
    code = 1
    try:
        index.save(path)
        code = 0
    except BaseException as exc:
        os.write(report, f"{type(exc).__name__}: {exc}"[:500].encode(errors="replace"))
    finally:
        os._exit(code)


def _child_failure(pid: int, report: BinaryIO) -> str:
    """Waits for the child (sleeping between looks, so the GIL is free) and says why it failed
    ("" when it did not); stops it past the limit."""
    deadline = time.monotonic() + CHILD_LIMIT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            said = (report.read() or b"").decode(errors="replace")
            return "" if code == 0 else said or f"exit code {code}"
        time.sleep(_POLL_S)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return f"still writing after {CHILD_LIMIT_S:.0f} s"
