"""Starts and stops the embedder: the model, the batcher and the gRPC server."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.embedder.batcher import MicroBatcher
from services.embedder.config import EmbedderConfig
from services.embedder.embedding import Embedder, ModelSet, opened_models
from services.embedder.servicer import EmbedderServicer
from shared.pb import embedder_pb2, embedder_pb2_grpc
from shared.rpc import ReadAtScrape, running_grpc_server
from shared.runtime import apply_log_level, until_stopped

log = logging.getLogger(__name__)

SERVICE_NAME = embedder_pb2.DESCRIPTOR.services_by_name["Embedder"].full_name


@dataclass(frozen=True)
class RunningEmbedder:
    """A started embedder: its bound address, its configured model and every model it runs."""

    address: str
    embedder: Embedder
    models: ModelSet


def batcher_metrics(batcher: MicroBatcher) -> Iterator[Metric]:
    """Model runs, texts embedded (their ratio is the mean batch) and calls waiting now."""
    yield CounterMetricFamily("hyatlas_embedder_runs", "Model runs (one batch each)",
                              value=batcher.runs)
    yield CounterMetricFamily("hyatlas_embedder_texts", "Texts embedded", value=batcher.texts_run)
    yield GaugeMetricFamily("hyatlas_embedder_queue_calls", "Embed calls waiting for a model run",
                            value=batcher.waiting_calls)


@contextlib.asynccontextmanager
async def running_server(config: EmbedderConfig) -> AsyncIterator[RunningEmbedder]:
    """Loads the model, starts the batcher, serves gRPC; stops all of it on exit."""
    async with contextlib.AsyncExitStack() as stack:
        models = await stack.enter_async_context(opened_models(config))
        embedder = models.configured

        def register(server: grpc.aio.Server) -> list[str]:
            embedder_pb2_grpc.add_EmbedderServicer_to_server(EmbedderServicer(models), server)
            return [SERVICE_NAME]

        metrics = ReadAtScrape(lambda: batcher_metrics(embedder.batcher))
        _, bound = await stack.enter_async_context(
            running_grpc_server(
                config.address, register, collectors=[metrics], token=config.grpc_token
            )
        )
        log.info("embedder %s ready on %s", embedder.model_id, bound)
        yield RunningEmbedder(bound, embedder, models)


async def main() -> None:
    """Runs the embedder until SIGTERM or SIGINT."""
    config = EmbedderConfig.from_env()
    apply_log_level(config.log_level)
    async with running_server(config):
        await until_stopped()
