"""Entry point: python -m services.search."""

from __future__ import annotations

from services.search.config import SearchConfig
from services.search.server import running_server
from shared.runtime import apply_log_level, run_service, until_stopped


async def main() -> None:
    """Serves search until SIGTERM or SIGINT."""
    config = SearchConfig.from_env()
    apply_log_level(config.log_level)
    async with running_server(config):
        await until_stopped()


if __name__ == "__main__":
    run_service("search", main)
