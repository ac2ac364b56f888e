"""Typed calls to the store, with gRPC errors turned into ServiceErrors."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, TypeVar

import grpc

from shared.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ServiceError,
    Unavailable,
)
from shared.pb import common_pb2, store_pb2, store_pb2_grpc

T = TypeVar("T")
_ERRORS: dict[grpc.StatusCode, type[ServiceError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.FAILED_PRECONDITION: Conflict,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
}


async def _call(call: Awaitable[T]) -> T:
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        error = _ERRORS.get(exc.code(), ServiceError)
        raise error(f"store: {exc.details() or exc.code().name}") from exc


class StoreClient:
    """Typed store calls over an open channel."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float = 60.0) -> None:
        self._stub = store_pb2_grpc.StoreStub(channel)
        self._timeout_s = timeout_s

    async def get(self, scope: common_pb2.Scope, memory_id: str) -> common_pb2.Memory:
        """One row in scope; NotFound otherwise."""
        reply = await _call(
            self._stub.GetMemory(
                store_pb2.GetMemoryRequest(scope=scope, id=memory_id), timeout=self._timeout_s
            )
        )
        return reply.memory

    async def apply(
        self, scope: common_pb2.Scope, ops: Sequence[store_pb2.Op], actor: str, reason: str
    ) -> list[common_pb2.Memory]:
        """Applies ops in one store transaction."""
        reply = await _call(
            self._stub.Apply(
                store_pb2.ApplyRequest(scope=scope, ops=list(ops), actor=actor, reason=reason),
                timeout=self._timeout_s,
            )
        )
        return list(reply.memories)

    async def list_rows(self, request: store_pb2.ListMemoriesRequest) -> list[common_pb2.Memory]:
        """A page of rows."""
        reply = await _call(self._stub.ListMemories(request, timeout=self._timeout_s))
        return list(reply.memories)

    async def vector_search(
        self,
        scope: common_pb2.Scope,
        vector: Iterable[float],
        model_id: str,
        layers: Sequence[Any],
        k: int,
        min_score: float,
    ) -> list[common_pb2.ScoredMemory]:
        """Live rows nearest to vector, none below min_score."""
        reply = await _call(
            self._stub.VectorSearch(
                store_pb2.VectorSearchRequest(
                    scope=scope,
                    vector=list(map(float, vector)),
                    model_id=model_id,
                    layers=list(layers),
                    k=k,
                    min_score=min_score,
                ),
                timeout=self._timeout_s,
            )
        )
        return list(reply.hits)


def update_op(memory_id: str, **fields: object) -> store_pb2.Op:
    """An Update op setting the given fields."""
    return store_pb2.Op(update=store_pb2.UpdateOp(id=memory_id, **fields))  # type: ignore[arg-type]


def retire_op(memory_id: str, how: str, by: str = "", reason: str = "") -> store_pb2.Op:
    """A Retire op."""
    return store_pb2.Op(
        retire=store_pb2.RetireOp(
            id=memory_id, superseded_how=how, superseded_by=by, drop_reason=reason
        )
    )


class GraphStoreClient(StoreClient):
    """The store calls of the slow path: state values, graph edges, pass undo."""

    async def state(self, prefix: str) -> dict[str, str]:
        """State values under a key prefix."""
        reply = await _call(
            self._stub.GetState(store_pb2.GetStateRequest(prefix=prefix), timeout=self._timeout_s)
        )
        return {v.key: v.value_json for v in reply.values}

    async def edges(
        self, scope: common_pb2.Scope, limit: int = 1000, include_stale: bool = False
    ) -> list[store_pb2.Edge]:
        """The live edges of a scope (with stale and ended ones if asked), newest first."""
        reply = await _call(
            self._stub.ListEdges(
                store_pb2.ListEdgesRequest(scope=scope, limit=limit, include_stale=include_stale),
                timeout=self._timeout_s,
            )
        )
        return list(reply.edges)

    async def undo_pass(self, pass_id: str, actor: str) -> store_pb2.UndoPassResponse:
        """Reverts one consolidation pass."""
        return await _call(
            self._stub.UndoPass(
                store_pb2.UndoPassRequest(pass_id=pass_id, actor=actor), timeout=self._timeout_s
            )
        )

    async def all_rows(self, request: store_pb2.ListMemoriesRequest) -> list[common_pb2.Memory]:
        """Every row a list request matches, page by page."""
        rows: list[common_pb2.Memory] = []
        page = store_pb2.ListMemoriesRequest()
        page.CopyFrom(request)
        page.limit = 1000
        while True:
            page.offset = len(rows)
            got = await self.list_rows(page)
            rows.extend(got)
            if len(got) < page.limit:
                return rows


def state_op(key: str, value: object) -> store_pb2.Op:
    """A SetState op holding value as JSON (None removes the key)."""
    text = "" if value is None else json.dumps(value, separators=(",", ":"))
    return store_pb2.Op(set_state=store_pb2.SetStateOp(key=key, value_json=text))
