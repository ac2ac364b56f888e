"""What the gateway keeps on its web.Application: config, service clients, counters."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from aiohttp import web

from gateway.config import GatewayConfig
from shared.rpc import ServiceClient


@dataclass
class Counters:
    """Requests served since this gateway process started (not persisted)."""

    writes: int = 0
    searches: int = 0


CONFIG = web.AppKey("config", GatewayConfig)
# Each backing service's stub; its calls raise ServiceErrors (shared.rpc is the one boundary).
STORE = web.AppKey("store", ServiceClient)
SEARCH = web.AppKey("search", ServiceClient)
EXTRACTOR = web.AppKey("extractor", ServiceClient)
CONSOLIDATOR = web.AppKey("consolidator", ServiceClient)
COUNTERS = web.AppKey("counters", Counters)
CHANNELS = web.AppKey("channels", dict[str, grpc.aio.Channel])
"""The open channel to each backing service, by service name (for health and readiness)."""
