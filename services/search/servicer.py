"""Search.SearchMemories: proto in, domain query through the engine, proto out."""

from __future__ import annotations

import grpc

from services.search.engine import SearchEngine
from services.search.model import Candidate, Scope, SearchQuery
from services.search.switches import switchable_names
from shared.errors import InvalidArgument
from shared.grants import current_grant
from shared.layers import LAYER_NAMES
from shared.pb import common_pb2, search_pb2, search_pb2_grpc
from shared.rpc import grpc_errors


def _layer_names(values: list[int]) -> list[str]:
    names = []
    for value in values:
        if value not in LAYER_NAMES:
            raise InvalidArgument(f"unknown layer {value}")
        names.append(LAYER_NAMES[value])
    return names


def _scored(candidate: Candidate, score: float) -> common_pb2.ScoredMemory:
    hit: common_pb2.ScoredMemory = candidate.payload
    return common_pb2.ScoredMemory(
        memory=hit.memory,
        score=score,
        replaced=hit.replaced,
        evidence=[e.payload.memory for e in candidate.evidence],
    )


def _stage_names(names: list[str]) -> list[str]:
    known = switchable_names()
    unknown = sorted({n.strip() for n in names if n.strip()} - set(known))
    if unknown:
        raise InvalidArgument(
            f"unknown search stage {', '.join(unknown)}: expected one of {', '.join(known)}"
        )
    return names


class SearchServicer(search_pb2_grpc.SearchServicer):
    """Translates SearchMemories calls for the search engine."""

    def __init__(self, engine: SearchEngine, default_min_score: float | None) -> None:
        self._engine = engine
        self._default_min_score = default_min_score

    @grpc_errors
    async def SearchMemories(
        self, request: search_pb2.SearchMemoriesRequest, context: grpc.aio.ServicerContext
    ) -> search_pb2.SearchMemoriesResponse:
        """Ranked channels for a query within one owner's scope."""
        grant = current_grant()
        if grant is not None:
            # Refused here, before any cached page or entity of the owner is used.
            grant.check_owner(request.scope.user_id, request.scope.agent_id)
        query = SearchQuery.build(
            scope=Scope(request.scope.user_id, request.scope.agent_id),
            text=request.query,
            limit=request.limit,
            layers=_layer_names(list(request.layers)),
            min_score=request.min_score if request.HasField("min_score") else None,
            default_min_score=self._default_min_score,
            reader=request.reader,
            session_id=request.session_id,
            reference_time=(
                request.reference_time if request.HasField("reference_time") else None
            ),
            reference_utc_offset_minutes=request.reference_utc_offset_minutes,
            skip_stages=_stage_names(list(request.skip_stages)),
        )
        result = await self._engine.search(query)
        reply = search_pb2.SearchMemoriesResponse(
            channels=[
                search_pb2.Channel(name=name, items=[_scored(c, c.score) for c in items])
                for name, items in result.channels.items()
            ],
            order=result.order,
        )
        if result.now is not None:
            # The Now page is not retrieved by similarity, so it carries no score.
            reply.now.CopyFrom(_scored(result.now, 0.0))
        return reply
