"""Entry point: `python -m gateway` serves the REST API until SIGTERM."""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.app import make_app
from gateway.config import GatewayConfig
from gateway.parser_errors import AppRunner
from shared.runtime import apply_log_level, run_service, until_stopped
from shared.settings import Settings

log = logging.getLogger("gateway")


async def main() -> None:
    """Serves until SIGTERM, then finishes requests in flight and closes the channels."""
    settings = Settings.from_env()
    config = GatewayConfig.from_settings(settings)
    apply_log_level(config.log_level)
    runner = AppRunner(
        make_app(config, settings),
        access_log=None,
        shutdown_timeout=10.0,
        # aiohttp starts this timer when a connection opens and after each reply, and closes a
        # connection still waiting for a whole request head when it fires: the header timeout.
        keepalive_timeout=config.header_timeout_s,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.http_host, config.http_port)
        await site.start()
        log.info("gateway listening on http://%s:%d", config.http_host, config.http_port)
        await until_stopped()
        log.info("gateway stopping")
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    run_service("gateway", main)
