"""Process entry points: structured logging, SIGTERM handling, background tasks, config errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from shared.errors import ConfigError

T = TypeVar("T")


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
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(service: str, level: str = "INFO") -> None:
    """Sends structured lines to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLineFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def apply_log_level(level: str) -> None:
    """Applies HYATLAS_LOG_LEVEL; every service's main() calls it right after reading its config."""
    logging.getLogger().setLevel(level)
    # gRPC's own debug lines would bury the ones DEBUG is asked for (search's per-stage timings).
    grpc_level = max(logging.INFO, logging.getLevelNamesMapping()[level])
    logging.getLogger("grpc").setLevel(grpc_level)


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


def run_service(service: str, main: Callable[[], Awaitable[None]]) -> None:
    """Runs a service's main(); a ConfigError exits with status 2 and says why."""
    setup_logging(service)
    try:
        asyncio.run(main())  # type: ignore[arg-type]
    except ConfigError as exc:
        logging.getLogger(service).error("cannot start: %s", exc)
        sys.exit(2)
