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
    configured_model_id: str = ""
    """The model the embedder is set up with (a store moves its vectors to it)."""


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

    async def embed_passages(
        self, passages: Sequence[Passage], model_id: str = "", *, bulk: bool = False
    ) -> tuple[np.ndarray, str]:
        """Unit vectors for each passage in order, its text's then its spans' (one model run
        gives both, see shared.passages), and the model id that made them (model_id's, or
        the served model's when empty); bulk work yields to the others' (EmbedRequest.bulk)."""
        rows: list[np.ndarray] = []
        made_by = ""
        for chunk in _chunks(passages):
            request = embedder_pb2.EmbedRequest(
                texts=[p.text for p in chunk],
                spans=[
                    embedder_pb2.Span(text=i, start=start, end=end)
                    for i, p in enumerate(chunk)
                    for start, end in p.spans
                ],
                model_id=model_id,
                bulk=bulk,
            )
            with rpc_errors("embedder"):
                reply = await self._stub.Embed(request, timeout=self._timeout_s)
            spans = iter(reply.span_vectors)
            for passage, vector in zip(chunk, reply.vectors, strict=True):
                rows.append(np.array(vector.values, dtype=np.float32))
                rows.extend(np.array(next(spans).values, dtype=np.float32) for _ in passage.spans)
            made_by = reply.model_id
        if not rows:
            return np.zeros((0, 0), dtype=np.float32), made_by
        return np.stack(rows), made_by

    async def describe(self, model_id: str = "") -> ModelInfo:
        """A model's id, dimension and whether it is semantic (the served model's by default)."""
        with rpc_errors("embedder"):
            reply = await self._stub.DescribeModel(
                embedder_pb2.DescribeModelRequest(model_id=model_id), timeout=self._timeout_s
            )
        return _info(reply)

    async def serve(self, model_id: str) -> ModelInfo:
        """Makes model_id the model calls naming none get (loading it); NotFound if unknown."""
        with rpc_errors("embedder"):
            reply = await self._stub.ServeModel(
                embedder_pb2.ServeModelRequest(model_id=model_id), timeout=self._timeout_s
            )
        return _info(reply)


def _info(reply: embedder_pb2.DescribeModelResponse) -> ModelInfo:
    return ModelInfo(reply.model_id, reply.ndim, reply.semantic, reply.configured_model_id)


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
