"""Starts and stops the store: embedder channel, database, vector indexes, gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from services.store.config import StoreConfig
from services.store.lifecycle import check_writable, open_store
from services.store.pg.lifecycle import open_pg_store
from services.store.servicer import StoreServicer
from services.store.store import Store
from shared.clients import EmbedderClient
from shared.pb import store_pb2, store_pb2_grpc
from shared.rpc import open_channel, running_grpc_server, wait_serving_patiently
from shared.runtime import apply_log_level, make_private, until_stopped

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running_store(config: StoreConfig) -> AsyncIterator[Store]:
    """The domain store, connected to the embedder, with its indexes loaded."""
    async with contextlib.AsyncExitStack() as stack:
        channel = open_channel(config.embedder_address, config.grpc_token)
        stack.push_async_callback(channel.close)
        # Every write and the vectors' model at open need the embedder: the store waits for it
        # (one warning line each embedder_warn_every_s) rather than exits to be restarted.
        await wait_serving_patiently(
            "embedder", config.embedder_address, config.embedder_warn_every_s
        )
        if config.store_dsn:
            yield await stack.enter_async_context(
                open_pg_store(
                    config.store_dsn,
                    config.data_dir,
                    EmbedderClient(channel),
                    config.user_aliases.group,
                    config.exact_search_up_to,
                    first_id=config.user_aliases.canonical,
                )
            )
            return
        store = await stack.enter_async_context(
            open_store(
                config.data_dir,
                EmbedderClient(channel),
                config.user_aliases.group,
                config.save_every_s,
                config.exact_search_up_to,
                config.index_cache_bytes,
                config.snapshots,
                config.reembed,
                first_id=config.user_aliases.canonical,
            )
        )
        yield store


@contextlib.asynccontextmanager
async def running_server(config: StoreConfig) -> AsyncIterator[str]:
    """Serves the Store service; yields the bound address. Indexes are saved on exit."""
    async with running_store(config) as store:
        servicer = StoreServicer(store)

        def register(server: grpc.aio.Server) -> list[str]:
            store_pb2_grpc.add_StoreServicer_to_server(servicer, server)
            return [store_pb2.DESCRIPTOR.services_by_name["Store"].full_name]

        serving = running_grpc_server(
            config.address, register, token=config.grpc_token, ready=store.answers
        )
        async with serving as (_, bound):
            yield bound


async def main() -> None:
    """Runs the store until SIGTERM or SIGINT."""
    config = StoreConfig.from_env()
    apply_log_level(config.log_level)
    await asyncio.to_thread(check_writable, config.data_dir)
    # The store owns the data: a folder left readable by an older version is closed up.
    for folder in (config.data_dir, config.snapshots.folder if config.snapshots else None):
        if folder is not None:
            await asyncio.to_thread(make_private, folder)
    async with running_server(config):
        await until_stopped()
