"""Typed async clients for the services other services call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from shared.pb import embedder_pb2, embedder_pb2_grpc
from shared.rpc import rpc_errors

# The most texts one Embed request may carry; the client splits longer lists.
MAX_TEXTS = 1024


@dataclass(frozen=True)
class ModelInfo:
    """What the embedder reports about its model."""

    model_id: str
    ndim: int
    semantic: bool


class EmbedderClient:
    """Calls the embedder service over an open channel."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float = 60.0) -> None:
        self._stub = embedder_pb2_grpc.EmbedderStub(channel)
        self._timeout_s = timeout_s

    async def embed(
        self, texts: Sequence[str], *, is_query: bool = False
    ) -> tuple[np.ndarray, str]:
        """Unit vectors for texts (float32, one row each) and the model id that made them."""
        parts, model_id = [], ""
        for start in range(0, max(len(texts), 1), MAX_TEXTS):
            chunk = list(texts[start : start + MAX_TEXTS])
            with rpc_errors("embedder"):
                reply = await self._stub.Embed(
                    embedder_pb2.EmbedRequest(texts=chunk, is_query=is_query),
                    timeout=self._timeout_s,
                )
            vectors = np.array([v.values for v in reply.vectors], dtype=np.float32)
            parts.append(vectors.reshape(len(chunk), reply.ndim))
            model_id = reply.model_id
        return np.concatenate(parts), model_id

    async def describe(self) -> ModelInfo:
        """The embedder's model id, dimension and whether it is semantic."""
        with rpc_errors("embedder"):
            reply = await self._stub.DescribeModel(
                embedder_pb2.DescribeModelRequest(), timeout=self._timeout_s
            )
        return ModelInfo(reply.model_id, reply.ndim, reply.semantic)
