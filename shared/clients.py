"""Typed async clients for the services other services call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from shared.passages import Passage
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

    async def embed_passages(self, passages: Sequence[Passage]) -> tuple[np.ndarray, str]:
        """Unit vectors for each passage in order, its text's then its spans' (one model run
        gives both, see shared.passages), and the model id that made them."""
        rows: list[np.ndarray] = []
        model_id = ""
        for chunk in _chunks(passages):
            request = embedder_pb2.EmbedRequest(
                texts=[p.text for p in chunk],
                spans=[
                    embedder_pb2.Span(text=i, start=start, end=end)
                    for i, p in enumerate(chunk)
                    for start, end in p.spans
                ],
            )
            with rpc_errors("embedder"):
                reply = await self._stub.Embed(request, timeout=self._timeout_s)
            spans = iter(reply.span_vectors)
            for passage, vector in zip(chunk, reply.vectors, strict=True):
                rows.append(np.array(vector.values, dtype=np.float32))
                rows.extend(np.array(next(spans).values, dtype=np.float32) for _ in passage.spans)
            model_id = reply.model_id
        if not rows:
            return np.zeros((0, 0), dtype=np.float32), model_id
        return np.stack(rows), model_id

    async def describe(self) -> ModelInfo:
        """The embedder's model id, dimension and whether it is semantic."""
        with rpc_errors("embedder"):
            reply = await self._stub.DescribeModel(
                embedder_pb2.DescribeModelRequest(), timeout=self._timeout_s
            )
        return ModelInfo(reply.model_id, reply.ndim, reply.semantic)


def _chunks(passages: Sequence[Passage]) -> list[Sequence[Passage]]:
    """Runs of passages within one request's limits (MAX_TEXTS texts, MAX_TEXTS spans)."""
    chunks: list[Sequence[Passage]] = []
    start = spans = 0
    for end, passage in enumerate(passages):
        if end > start and (end - start == MAX_TEXTS or spans + len(passage.spans) > MAX_TEXTS):
            chunks.append(passages[start:end])
            start, spans = end, 0
        spans += len(passage.spans)
    if start < len(passages):
        chunks.append(passages[start:])
    return chunks
