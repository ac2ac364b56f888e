"""Starts and stops the consolidator: store and embedder channels, the pass loop, gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.consolidator.config import ConsolidatorConfig
from services.consolidator.passes import Busy, Consolidator
from services.consolidator.servicer import ConsolidatorServicer
from shared.clients import EmbedderClient
from shared.errors import ServiceError
from shared.leases import LeasePolicy, Leases
from shared.llm import llm_client
from shared.pb import consolidator_pb2, consolidator_pb2_grpc
from shared.rpc import (
    ReadAtScrape,
    open_channel,
    running_grpc_server,
    wait_serving_patiently,
)
from shared.runtime import apply_log_level, background, until_stopped
from shared.store_client import GraphStoreClient

log = logging.getLogger(__name__)


def pass_metrics(consolidator: Consolidator) -> Iterator[Metric]:
    """Passes run since start, whether one runs now, and when the last one ended."""
    yield CounterMetricFamily("hyatlas_consolidation_passes", "Consolidation passes run",
                              value=consolidator.runs)
    yield GaugeMetricFamily("hyatlas_consolidation_running", "1 while a pass runs",
                            value=1.0 if consolidator.running else 0.0)
    yield GaugeMetricFamily("hyatlas_consolidation_last_pass_timestamp_seconds",
                            "When the last pass ended (unix seconds; 0: none yet)",
                            value=consolidator.last_at)


async def run_schedule(consolidator: Consolidator, config: ConsolidatorConfig) -> None:
    """A catch-up pass at start when clusters are due, then one every EVERY (CATCHUP while due)."""
    due = await due_at_start(consolidator, config)
    wait = 0.0 if due else config.every_s
    if due:
        log.info("%d clusters are due: starting with a catch-up pass", due)
    while True:
        await asyncio.sleep(wait)
        try:
            report = await consolidator.run_pass()
        except Busy:
            wait = config.catchup_s or config.every_s
            continue
        except ServiceError as exc:
            log.warning("consolidation pass failed: %s", exc.message)
            wait = config.catchup_s or config.every_s
            continue
        except Exception:  # a bug: logged whole, and the schedule goes on
            log.exception("consolidation pass failed")
            wait = config.every_s
            continue
        pending = report.clusters_pending > 0
        wait = (config.catchup_s or config.every_s) if pending else config.every_s


async def due_at_start(consolidator: Consolidator, config: ConsolidatorConfig) -> int:
    """How many clusters are due at start. While another replica holds the pass lease this asks
    again every lease ttl: a replica killed mid-pass has lost it by then."""
    while True:
        try:
            return await consolidator.pending()
        except Busy as exc:
            log.info("clusters are surveyed once the pass lease is free: %s", exc.message)
            await asyncio.sleep(config.lease_ttl_s)
        except ServiceError as exc:
            log.warning("could not survey the clusters at start: %s", exc.message)
            return 0


@contextlib.asynccontextmanager
async def running_server(config: ConsolidatorConfig) -> AsyncIterator[str]:
    """Serves the Consolidator service; yields the bound address."""
    async with contextlib.AsyncExitStack() as stack:
        store_channel = open_channel(config.store_address, config.grpc_token)
        stack.push_async_callback(store_channel.close)
        embedder_channel = open_channel(config.embedder_address, config.grpc_token)
        stack.push_async_callback(embedder_channel.close)
        # Nothing is extracted or consolidated without them: this waits for them (a warning
        # line each warn_every_s) rather than exits to be restarted into the same wait.
        await wait_serving_patiently("store", config.store_address, config.warn_every_s)
        await wait_serving_patiently("embedder", config.embedder_address, config.warn_every_s)
        store = GraphStoreClient(store_channel, timeout_s=120.0)
        consolidator = Consolidator(
            config,
            store,
            EmbedderClient(embedder_channel),
            llm_client(config.llm),
            config.user_aliases.canonical,
            Leases(store, LeasePolicy(config.lease_ttl_s, config.lease_poll_s)),
        )
        stack.push_async_callback(consolidator.stop)  # before the channels close
        servicer = ConsolidatorServicer(consolidator, ultra=config.mode == "ultra")

        def register(server: grpc.aio.Server) -> list[str]:
            consolidator_pb2_grpc.add_ConsolidatorServicer_to_server(servicer, server)
            return [consolidator_pb2.DESCRIPTOR.services_by_name["Consolidator"].full_name]

        # Started before the gRPC server is entered, so that on exit the server stops first.
        if config.mode == "ultra":
            background(stack, run_schedule(consolidator, config), "passes")
        metrics = ReadAtScrape(lambda: pass_metrics(consolidator))
        _, bound = await stack.enter_async_context(
            running_grpc_server(
                config.address, register, collectors=[metrics], token=config.grpc_token
            )
        )
        log.info("consolidator: mode %s, every %ss", config.mode, config.every_s)
        yield bound


async def main() -> None:
    """Runs the consolidator until SIGTERM or SIGINT."""
    config = ConsolidatorConfig.from_env()
    apply_log_level(config.log_level)
    async with running_server(config):
        await until_stopped()
