"""Background tasks are owned by an exit stack: stopped with it, and never fail in silence."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.runtime import MALLOC_ARENAS, background

ROOT = Path(__file__).resolve().parent.parent


async def test_a_background_task_is_cancelled_and_awaited_when_its_stack_unwinds() -> None:
    async with contextlib.AsyncExitStack() as stack:
        task = background(stack, asyncio.Event().wait(), "idle")
        assert task.get_name() == "idle" and not task.done()
    assert task.cancelled()


async def test_a_background_task_that_died_raises_its_error_when_its_stack_unwinds() -> None:
    async def broken() -> None:
        raise RuntimeError("the loop broke")

    with pytest.raises(RuntimeError, match="the loop broke"):
        async with contextlib.AsyncExitStack() as stack:
            task = background(stack, broken(), "broken")
            await asyncio.wait([task])


# Eight threads that each malloc (zlib's state) in a fresh interpreter, then the number of heaps
# (arenas) glibc reports.
_ARENAS_AFTER_THREADS = """
import ctypes, sys, tempfile, threading, zlib
from shared.runtime import limit_malloc_arenas
if sys.argv[1] == "limited":
    limit_malloc_arenas()
data = bytes(range(256)) * 4096
def churn():
    for _ in range(20):
        zlib.compress(data)
threads = [threading.Thread(target=churn) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile("r") as out:
    stream = ctypes.c_void_p(libc.fopen(out.name.encode(), b"w"))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(out.read().count("<heap nr="))
"""


def _arenas(how: str, **env: str) -> int:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    environ["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", _ARENAS_AFTER_THREADS, how],
        capture_output=True, text=True, check=True, env=environ,
    )
    return int(done.stdout)


def test_a_service_process_keeps_to_two_malloc_arenas_however_many_threads_it_runs() -> None:
    assert _arenas("default") > MALLOC_ARENAS  # what glibc does unasked
    assert _arenas("limited") == MALLOC_ARENAS
    # A limit the environment sets is glibc's own, and left alone.
    assert _arenas("limited", MALLOC_ARENA_MAX="3") == 3
