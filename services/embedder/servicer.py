"""Embedder gRPC servicer: proto <-> domain conversion and error mapping only."""

from __future__ import annotations

import grpc
import numpy as np

from services.embedder.embedding import Embedder, ModelSet
from shared.errors import InvalidArgument
from shared.passages import Passage
from shared.pb import embedder_pb2, embedder_pb2_grpc
from shared.rpc import grpc_errors


def passages_of(request: embedder_pb2.EmbedRequest) -> tuple[list[Passage], list[tuple[int, int]]]:
    """The request's texts with their spans, and where each requested span went (its text,
    its place among that text's spans)."""
    spans: list[list[tuple[int, int]]] = [[] for _ in request.texts]
    order = []
    for span in request.spans:
        if not 0 <= span.text < len(request.texts):
            raise InvalidArgument(f"a span names text {span.text}; there are {len(spans)}")
        order.append((span.text, len(spans[span.text])))
        spans[span.text].append((span.start, span.end))
    passages = [Passage(text, tuple(s)) for text, s in zip(request.texts, spans, strict=True)]
    return passages, order


class EmbedderServicer(embedder_pb2_grpc.EmbedderServicer):
    """Serves Embed, DescribeModel and ServeModel from a set of models."""

    def __init__(self, models: ModelSet) -> None:
        self._models = models

    @grpc_errors
    async def Embed(
        self, request: embedder_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedder_pb2.EmbedResponse:
        if request.is_query and request.bulk:
            raise InvalidArgument("a query is never bulk work: it runs first")
        embedder = await self._models.get(request.model_id)
        if not request.spans and not request.bulk:
            vectors = await embedder.embed(list(request.texts), is_query=request.is_query)
            return self._reply(embedder, vectors, [])
        if request.is_query:
            raise InvalidArgument("spans are for documents, not queries")
        passages, order = passages_of(request)
        rows = await embedder.embed_passages(passages, bulk=request.bulk)
        firsts = np.cumsum([0] + [p.rows for p in passages[:-1]])
        return self._reply(embedder, rows[firsts], [rows[firsts[t] + 1 + j] for t, j in order])

    def _reply(
        self, embedder: Embedder, vectors: np.ndarray, spans: list[np.ndarray]
    ) -> embedder_pb2.EmbedResponse:
        return embedder_pb2.EmbedResponse(
            vectors=[embedder_pb2.Vector(values=row.tolist()) for row in vectors],
            model_id=embedder.model_id,
            ndim=int(vectors.shape[1]),
            span_vectors=[embedder_pb2.Vector(values=row.tolist()) for row in spans],
        )

    @grpc_errors
    async def DescribeModel(
        self, request: embedder_pb2.DescribeModelRequest, context: grpc.aio.ServicerContext
    ) -> embedder_pb2.DescribeModelResponse:
        return await self._describe(await self._models.get(request.model_id))

    @grpc_errors
    async def ServeModel(
        self, request: embedder_pb2.ServeModelRequest, context: grpc.aio.ServicerContext
    ) -> embedder_pb2.DescribeModelResponse:
        if not request.model_id:
            raise InvalidArgument("model_id is required")
        return await self._describe(await self._models.serve(request.model_id))

    async def _describe(self, embedder: Embedder) -> embedder_pb2.DescribeModelResponse:
        info = await embedder.describe()
        return embedder_pb2.DescribeModelResponse(
            model_id=info.model_id,
            ndim=info.ndim,
            semantic=info.semantic,
            pooling=info.pooling,
            max_tokens=info.max_tokens,
            query_prefix=info.query_prefix,
            configured_model_id=self._models.configured.model_id,
        )
