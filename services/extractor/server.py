"""Starts and stops the extractor: store and embedder channels, the worker, the gRPC server."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

import grpc
from prometheus_client.core import CounterMetricFamily, Metric

from services.extractor.config import ExtractorConfig
from services.extractor.extract import Counters, Extraction
from services.extractor.living import Living
from services.extractor.reconcile import Reconciler
from services.extractor.servicer import ExtractorServicer
from services.extractor.worker import CatchupPolicy, Worker, llm_state
from shared.clients import EmbedderClient
from shared.leases import LeasePolicy, Leases
from shared.llm import llm_client
from shared.pb import extractor_pb2, extractor_pb2_grpc
from shared.rpc import (
    ReadAtScrape,
    open_channel,
    running_grpc_server,
    wait_serving_patiently,
)
from shared.runtime import apply_log_level, background, until_stopped
from shared.store_client import StoreClient

log = logging.getLogger(__name__)


def extraction_metrics(counters: Counters) -> Iterator[Metric]:
    """Extractions by outcome, model ops dropped, forgotten values refused."""
    outcomes = CounterMetricFamily("hyatlas_extractions", "Extractions by outcome",
                                   labels=["outcome"])
    outcomes.add_metric(["extracted"], counters.extracted)
    outcomes.add_metric(["failed"], counters.failed)
    yield outcomes
    yield CounterMetricFamily("hyatlas_extraction_dropped_ops",
                              "Model ops dropped (numbers it was not shown, bad shapes)",
                              value=counters.dropped_ops)
    yield CounterMetricFamily("hyatlas_extraction_refused_forgotten",
                              "Values refused because the user had forgotten them",
                              value=counters.refused_forgotten)


@contextlib.asynccontextmanager
async def running_server(config: ExtractorConfig) -> AsyncIterator[str]:
    """Serves the Extractor service; yields the bound address.

    On exit the gRPC server stops first, then the catch-up and episode loops, then extractions
    in flight get up to stop_grace_s, then Now pages still waiting are dropped.
    """
    async with contextlib.AsyncExitStack() as stack:
        store_channel = open_channel(config.store_address, config.grpc_token)
        stack.push_async_callback(store_channel.close)
        embedder_channel = open_channel(config.embedder_address, config.grpc_token)
        stack.push_async_callback(embedder_channel.close)
        # Nothing is extracted or consolidated without them: this waits for them (a warning
        # line each warn_every_s) rather than exits to be restarted into the same wait.
        await wait_serving_patiently("store", config.store_address, config.warn_every_s)
        await wait_serving_patiently("embedder", config.embedder_address, config.warn_every_s)
        store = StoreClient(store_channel)
        embedder = EmbedderClient(embedder_channel)
        llm = llm_client(config.llm)
        leases = Leases(store, LeasePolicy(config.lease_ttl_s, config.lease_poll_s))
        extraction = Extraction(
            store,
            embedder,
            llm,
            dedupe_score=config.dedupe_score,
            related_facts=config.related_facts,
            reconciler=Reconciler(store, llm) if config.reconcile else None,
        )
        living = Living(
            store,
            extraction.llm,
            lambda: llm_state(config.mode, extraction.llm) == "ok",
            config.user_aliases.canonical,
            config.now_every_s,
            config.episode_gap_s,
            config.mode,
            leases,
            config.intention_ttl_s,
        )
        worker = Worker(
            extraction,
            store,
            config.mode,
            CatchupPolicy(
                every_s=config.catchup_every_s,
                max_age_s=config.catchup_max_age_s,
                min_age_s=config.catchup_min_age_s,
                batch=config.catchup_batch,
                tries=config.catchup_tries,
            ),
            leases,
            living,
        )
        stack.push_async_callback(living.drain)
        await living.resume()
        stack.push_async_callback(worker.drain, config.stop_grace_s)
        background(stack, worker.run_catchup(), "catch-up")
        background(stack, living.run_episodes(), "episodes")
        servicer = ExtractorServicer(worker)

        def register(server: grpc.aio.Server) -> list[str]:
            extractor_pb2_grpc.add_ExtractorServicer_to_server(servicer, server)
            return [extractor_pb2.DESCRIPTOR.services_by_name["Extractor"].full_name]

        metrics = ReadAtScrape(lambda: extraction_metrics(extraction.counters))
        _, bound = await stack.enter_async_context(
            running_grpc_server(
                config.address, register, collectors=[metrics], token=config.grpc_token
            )
        )
        log.info("extractor: mode %s, llm %s", config.mode, worker.llm_state())
        yield bound


async def main() -> None:
    """Runs the extractor until SIGTERM or SIGINT."""
    config = ExtractorConfig.from_env()
    apply_log_level(config.log_level)
    async with running_server(config):
        await until_stopped()
