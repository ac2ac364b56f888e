"""Builds the gateway's aiohttp application."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from gateway import admission, dashboard, metrics, openapi, readiness
from gateway.config import GatewayConfig
from gateway.errors import errors_middleware
from gateway.grants import TOKENS, TokenBook
from gateway.guards import guards_middleware, token_middleware
from gateway.read_timeouts import body_timeout_middleware
from gateway.routes import (
    admin,
    digest,
    extraction,
    graph,
    memories,
    owners,
    search,
    status,
    transfer,
)
from gateway.state import (
    CHANNELS,
    CONFIG,
    CONSOLIDATOR,
    COUNTERS,
    EXTRACTOR,
    SEARCH,
    STORE,
    Counters,
)
from shared.pb import (
    consolidator_pb2_grpc,
    extractor_pb2_grpc,
    search_pb2_grpc,
    store_pb2_grpc,
)
from shared.rpc import ServiceClient, open_channel
from shared.settings import MODE_SERVICES, Settings


async def _channels(app: web.Application) -> AsyncIterator[None]:
    """Opens the channels to the other services for the app's lifetime."""
    config = app[CONFIG]
    async with (
        open_channel(config.embedder_address, config.grpc_token) as embedder,
        open_channel(config.store_address, config.grpc_token) as store,
        open_channel(config.search_address, config.grpc_token) as search,
        open_channel(config.extractor_address, config.grpc_token) as extractor,
        open_channel(config.consolidator_address, config.grpc_token) as consolidator,
    ):
        every = {
            "embedder": embedder,
            "store": store,
            "search": search,
            "extractor": extractor,
            "consolidator": consolidator,
        }
        app[CHANNELS] = {name: every[name] for name in MODE_SERVICES[config.mode]}
        app[STORE] = ServiceClient(store_pb2_grpc.StoreStub(store), "store")
        app[SEARCH] = ServiceClient(search_pb2_grpc.SearchStub(search), "search")
        app[EXTRACTOR] = ServiceClient(extractor_pb2_grpc.ExtractorStub(extractor), "extractor")
        app[CONSOLIDATOR] = ServiceClient(
            consolidator_pb2_grpc.ConsolidatorStub(consolidator), "consolidator"
        )
        yield


def make_app(config: GatewayConfig, settings: Settings) -> web.Application:
    """The REST application: guards and token checks around every route, JSON errors outside."""
    app = web.Application(
        # metrics outermost so every answer is counted with the status it went out with; then
        # admission, which sees every answer's final status (a 503 gets Retry-After); then
        # errors, so that guard refusals and aiohttp's own 404/405/413 become JSON too. The body
        # is read (within its timeout) only once the caller passed every check.
        middlewares=[metrics.metrics_middleware, admission.admission_middleware,
                     errors_middleware, guards_middleware, token_middleware,
                     body_timeout_middleware],
        client_max_size=config.max_body_bytes,
    )
    app[CONFIG] = config
    app[TOKENS] = TokenBook.open(config.token, config.tokens_file)
    app[COUNTERS] = Counters()
    app.cleanup_ctx.append(_channels)
    admission.register(app)
    metrics.register(app)
    for module in (
        readiness, status, memories, owners, search, extraction, digest, graph, admin, transfer,
        openapi,
    ):
        app.add_routes(module.routes)
    dashboard.register(app, settings)
    return app
