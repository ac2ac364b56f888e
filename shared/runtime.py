"""Process entry points: structured logging, SIGTERM handling, background tasks, config errors."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from shared.errors import ConfigError
from shared.redact import redact_text

T = TypeVar("T")

# Whatever a service creates (folders, the database, index files, unix sockets) is its user's
# alone: folders 0700, files 0600, sockets no other account can connect to.
PRIVATE_UMASK = 0o077


class JsonLineFormatter(logging.Formatter):
    """One JSON object per log line: time, level, service, logger, message."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            # Every line, a library's too, loses the secrets a URL in it may carry.
            "msg": redact_text(record.getMessage()),
        }
        if record.exc_info:
            entry["exc"] = redact_text(self.formatException(record.exc_info))
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(service: str, level: str = "INFO") -> None:
    """Sends structured lines to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLineFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


# The project's own loggers: DEBUG reaches these only.
OWN_LOGGERS = ("services", "shared", "gateway", "hyatlas_cli", "__main__")


def apply_log_level(level: str) -> None:
    """Applies HYATLAS_LOG_LEVEL; every service's main() calls it right after reading its config.

    Libraries log at INFO at most: their debug lines would bury the ones DEBUG is asked for
    (search's per-stage timings), and aiosqlite's repeat every statement's parameters, the
    memories' texts and vectors among them.
    """
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(level)
    libraries = max(logging.INFO, logging.getLevelNamesMapping()[level])
    logging.getLogger().setLevel(libraries)


def background(
    stack: contextlib.AsyncExitStack, coro: Coroutine[Any, Any, T], name: str
) -> asyncio.Task[T]:
    """Runs coro as a task the stack owns: unwinding the stack cancels the task and awaits it.

    Every server stops in this order on SIGTERM: gRPC health turns NOT_SERVING and the server
    stops taking calls, then background loops stop, then work in flight drains, then channels
    close. A stack unwinds last in first out, so a server enters them the other way round:
    channels, the drains, background tasks, and the gRPC server last.
    """
    task = asyncio.create_task(coro, name=name)
    stack.push_async_callback(_cancel_and_wait, task)
    return task


async def _cancel_and_wait(task: asyncio.Task[Any]) -> None:
    task.cancel()
    # wait() instead of awaiting the task: were the stopping code itself cancelled, that
    # cancellation must propagate, not be taken for the task's own and swallowed.
    await asyncio.wait([task])
    if not task.cancelled():
        task.result()  # a loop that died of an error says so instead of vanishing


async def until_stopped() -> None:
    """Returns when SIGTERM or SIGINT arrives."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def make_private(folder: Path) -> None:
    """Takes group and other access off an existing folder and everything in it (a data
    directory made before the services set their umask); symlinks are left alone."""
    if not folder.is_dir():
        return
    folder.chmod(0o700)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            _chmod_unless_link(Path(root, name), 0o700)
        for name in files:
            _chmod_unless_link(Path(root, name), 0o600)


def _chmod_unless_link(path: Path, mode: int) -> None:
    with contextlib.suppress(FileNotFoundError):  # a file may go while the walk runs
        if not path.is_symlink():
            path.chmod(mode)


# glibc gives a thread that finds the heap busy an arena of its own (up to eight a core), and
# what is freed in an arena stays mapped there: with the threads of tantivy, SQLite and gRPC the
# store held 744-795 MB after seeding 100,000 memories with the default, 661-691 with two.
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter number for it (malloc.h)


def limit_malloc_arenas() -> bool:
    """Caps glibc's malloc arenas at MALLOC_ARENAS, unless MALLOC_ARENA_MAX says otherwise
    (glibc reads that itself). False where there is no glibc mallopt."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, MALLOC_ARENAS))
    except (OSError, AttributeError):
        return False


def trim_heap() -> bool:
    """Hands the pages glibc's heaps hold free back to the system (malloc_trim): what a burst
    of work freed stays resident otherwise. False where there is no glibc malloc_trim."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


CANNOT_START = 2
"""A service's exit status when it cannot start (a ConfigError): supervisord and systemd do not
restart it (deploy/), and make run reports it."""


def run_service(service: str, main: Callable[[], Awaitable[None]]) -> None:
    """Runs a service's main() with a private umask and few malloc arenas; a ConfigError exits
    with CANNOT_START."""
    os.umask(PRIVATE_UMASK)
    limit_malloc_arenas()
    setup_logging(service)
    try:
        asyncio.run(main())  # type: ignore[arg-type]
    except ConfigError as exc:
        logging.getLogger(service).error("cannot start: %s", exc)
        sys.exit(CANNOT_START)
