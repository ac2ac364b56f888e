"""Process entry points: structured logging, SIGTERM handling, config errors."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable

from shared.errors import ConfigError


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
