"""running_server: the search gRPC server and its channels to the store and the embedder."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from services.search.backend import GrpcBackend
from services.search.config import SearchConfig
from services.search.engine import SearchEngine
from services.search.pipeline import LITE_PIPELINE
from services.search.servicer import SearchServicer
from shared.clients import EmbedderClient
from shared.pb import search_pb2, search_pb2_grpc
from shared.rpc import open_channel, running_grpc_server

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running_server(config: SearchConfig) -> AsyncIterator[str]:
    """Serves Search on config.address until exit; yields the bound address."""
    async with contextlib.AsyncExitStack() as stack:
        store_channel = await stack.enter_async_context(
            open_channel(config.store_address, config.grpc_token)
        )
        embedder_channel = await stack.enter_async_context(
            open_channel(config.embedder_address, config.grpc_token)
        )
        pipeline = LITE_PIPELINE.without(config.pipeline_stages_off())
        engine = SearchEngine(
            GrpcBackend(store_channel, EmbedderClient(embedder_channel)),
            pipeline,
            intention_ttl_s=config.intention_ttl_s,
            now_pages=config.now_pages,
            graph_recall=config.graph_recall,
            settings=config.ranking,
            disabled=config.disabled_stages,
        )
        servicer = SearchServicer(engine, config.min_score)

        def register(server: grpc.aio.Server) -> list[str]:
            search_pb2_grpc.add_SearchServicer_to_server(servicer, server)
            return [search_pb2.DESCRIPTOR.services_by_name["Search"].full_name]

        _, bound = await stack.enter_async_context(
            running_grpc_server(config.address, register, token=config.grpc_token)
        )
        log.info("search stages: %s", ", ".join(pipeline.names))
        yield bound
