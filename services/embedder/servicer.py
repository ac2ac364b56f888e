"""Embedder gRPC servicer: proto <-> domain conversion and error mapping only."""

from __future__ import annotations

import grpc

from services.embedder.embedding import Embedder
from shared.pb import embedder_pb2, embedder_pb2_grpc
from shared.rpc import grpc_errors


class EmbedderServicer(embedder_pb2_grpc.EmbedderServicer):
    """Serves Embed and DescribeModel from one Embedder."""

    def __init__(self, embedder: Embedder) -> None:
        self._embedder = embedder

    @grpc_errors
    async def Embed(
        self, request: embedder_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedder_pb2.EmbedResponse:
        vectors = await self._embedder.embed(list(request.texts), is_query=request.is_query)
        return embedder_pb2.EmbedResponse(
            vectors=[embedder_pb2.Vector(values=row.tolist()) for row in vectors],
            model_id=self._embedder.model_id,
            ndim=int(vectors.shape[1]),
        )

    @grpc_errors
    async def DescribeModel(
        self, request: embedder_pb2.DescribeModelRequest, context: grpc.aio.ServicerContext
    ) -> embedder_pb2.DescribeModelResponse:
        info = await self._embedder.describe()
        return embedder_pb2.DescribeModelResponse(
            model_id=info.model_id,
            ndim=info.ndim,
            semantic=info.semantic,
            pooling=info.pooling,
            max_tokens=info.max_tokens,
            query_prefix=info.query_prefix,
        )
