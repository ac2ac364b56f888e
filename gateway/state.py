"""What the gateway keeps on its web.Application: config, gRPC stubs, counters."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from aiohttp import web

from gateway.config import GatewayConfig
from shared.pb import (
    consolidator_pb2_grpc,
    extractor_pb2_grpc,
    search_pb2_grpc,
    store_pb2_grpc,
)


@dataclass
class Counters:
    """Requests served since this gateway process started (not persisted)."""

    writes: int = 0
    searches: int = 0


CONFIG = web.AppKey("config", GatewayConfig)
STORE = web.AppKey("store", store_pb2_grpc.StoreStub)
SEARCH = web.AppKey("search", search_pb2_grpc.SearchStub)
EXTRACTOR = web.AppKey("extractor", extractor_pb2_grpc.ExtractorStub)
CONSOLIDATOR = web.AppKey("consolidator", consolidator_pb2_grpc.ConsolidatorStub)
COUNTERS = web.AppKey("counters", Counters)
CHANNELS = web.AppKey("channels", dict[str, grpc.aio.Channel])
"""The open channel to each backing service, by service name (for health and readiness)."""
