"""The search backend over gRPC: the embedder for the query vector, the store for hits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import grpc

from services.search.graph import GraphEdge
from services.search.model import Candidate, Scope
from shared.clients import EmbedderClient
from shared.layers import LAYER_NAMES, LAYERS_BY_NAME
from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import ServiceClient
from shared.store_client import get_many


def to_candidate(
    hit: common_pb2.ScoredMemory,
    *,
    cosine: float | None = None,
    keyword_fraction: float | None = None,
) -> Candidate:
    """A store hit as a pipeline candidate; the hit itself rides along as the payload."""
    memory = hit.memory
    return Candidate(
        memory_id=memory.id,
        layer=LAYER_NAMES.get(memory.layer, ""),
        content=memory.content,
        label=memory.label,
        session_id=memory.owner.session_id,
        follows_id=hit.follows_id,
        created_at=memory.created_at,
        due_at=memory.due_at if memory.HasField("due_at") else None,
        event_at=memory.event_at if memory.HasField("event_at") else None,
        utc_offset_minutes=memory.utc_offset_minutes,
        valid_to=memory.valid_to if memory.HasField("valid_to") else None,
        source_ids=tuple(memory.source_ids),
        hits=memory.hits,
        cosine=cosine,
        keyword_fraction=keyword_fraction,
        payload=hit,
    )


def _scope(scope: Scope) -> common_pb2.Scope:
    return common_pb2.Scope(user_id=scope.user_id, agent_id=scope.agent_id)


def _layers(names: Sequence[str]) -> list[common_pb2.Layer]:
    return cast("list[common_pb2.Layer]", [LAYERS_BY_NAME[name] for name in names])


class GrpcBackend:
    """Reads query vectors from the embedder and hits from the store."""

    def __init__(
        self,
        store_channel: grpc.aio.Channel,
        embedder: EmbedderClient,
        timeout_s: float = 30.0,
    ) -> None:
        self._store = ServiceClient(store_pb2_grpc.StoreStub(store_channel), "store")
        self._embedder = embedder
        self._timeout_s = timeout_s

    async def embed_query(self, text: str) -> tuple[Sequence[float], str]:
        """The query's vector and the model id that made it."""
        vectors, model_id = await self._embedder.embed([text], is_query=True)
        return vectors[0].tolist(), model_id

    async def vector_search(
        self, scope: Scope, vector: Sequence[float], model_id: str, layers: Sequence[str], k: int
    ) -> list[Candidate]:
        """The k nearest live memories (one per text and owner) with their cosine; the floor is
        left to fusion."""
        request = store_pb2.VectorSearchRequest(
            scope=_scope(scope),
            vector=vector,
            model_id=model_id,
            layers=_layers(layers),
            k=k,
            min_score=0.0,
            distinct_text=True,
        )
        reply = await self._store.VectorSearch(request, timeout=self._timeout_s)
        return [to_candidate(hit, cosine=hit.score) for hit in reply.hits]

    async def cosines(
        self, scope: Scope, vector: Sequence[float], model_id: str, ids: Sequence[str]
    ) -> dict[str, float]:
        """The cosine of each of these memories (its nearest key) with vector; one without a
        vector, or out of scope, is left out."""
        request = store_pb2.VectorSearchRequest(
            scope=_scope(scope), vector=vector, model_id=model_id, ids=ids, include_superseded=True
        )
        reply = await self._store.VectorSearch(request, timeout=self._timeout_s)
        return {hit.memory.id: hit.score for hit in reply.hits}

    async def keyword_search(
        self,
        scope: Scope,
        text: str,
        layers: Sequence[str],
        k: int,
        *,
        relaxed: bool = False,
        context: bool = False,
    ) -> tuple[list[Candidate], list[Candidate]]:
        """Memories holding the query's terms (one per text and owner), best score first, and those
        whose context holds them.

        Strict: the reference's rule decides which rows count. Relaxed: any term counts, and each
        hit says whether it also passes the strict rule.
        """
        request = store_pb2.KeywordSearchRequest(
            scope=_scope(scope),
            query=text,
            layers=_layers(layers),
            k=k,
            min_terms=1 if relaxed else 0,
            context_keys=context,
            distinct_text=True,
        )
        reply = await self._store.KeywordSearch(request, timeout=self._timeout_s)
        terms = len(reply.terms)
        own = []
        for found in reply.hits:
            candidate = to_candidate(
                found.hit,
                keyword_fraction=min(1.0, found.matched_terms / terms) if terms else None,
            )
            candidate.keyword_score = found.hit.score
            candidate.strict = found.matched_terms >= reply.required_terms
            own.append(candidate)
        around = []
        for found in reply.context_hits:
            candidate = to_candidate(found.hit)
            candidate.context_score = found.hit.score
            around.append(candidate)
        return own, around

    async def newest(
        self, scope: Scope, layers: Sequence[str], k: int, label: str = ""
    ) -> list[Candidate]:
        """The k newest live memories of the layers (with that label, if one is given)."""
        request = store_pb2.ListMemoriesRequest(
            scope=_scope(scope), layers=_layers(layers), limit=k, order="newest", label=label
        )
        reply = await self._store.ListMemories(request, timeout=self._timeout_s)
        return [
            to_candidate(common_pb2.ScoredMemory(memory=memory)) for memory in reply.memories
        ]

    async def live_edges(self, scope: Scope, limit: int) -> list[GraphEdge]:
        """The scope's live L5 edges (not stale, not ended)."""
        request = store_pb2.ListEdgesRequest(scope=_scope(scope), limit=limit)
        reply = await self._store.ListEdges(request, timeout=self._timeout_s)
        return [
            GraphEdge(e.subject, e.object, tuple(e.fact_ids), e.memory_id) for e in reply.edges
        ]

    async def memories(self, scope: Scope, ids: Sequence[str]) -> list[Candidate]:
        """The live memories with these ids, in order; missing or retired ones left out."""
        found = await get_many(self._store, _scope(scope), ids, self._timeout_s)
        return [
            to_candidate(common_pb2.ScoredMemory(memory=m))
            for m in found
            if m.status in ("", "active")
        ]
