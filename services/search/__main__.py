"""Entry point: python -m services.search."""

from __future__ import annotations

import logging

from services.search.config import SearchConfig
from services.search.server import running_server
from shared.runtime import run_service, until_stopped


async def main() -> None:
    """Serves search until SIGTERM or SIGINT."""
    config = SearchConfig.from_env()
    logging.getLogger().setLevel(config.log_level)
    # gRPC's own debug lines would bury the per-search timings DEBUG is asked for.
    logging.getLogger("grpc").setLevel(logging.INFO)
    async with running_server(config):
        await until_stopped()


if __name__ == "__main__":
    run_service("search", main)
