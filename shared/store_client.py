"""Typed calls to the store (errors as ServiceErrors) and pagers for callers that want every row."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from shared.owner_state import owner_key
from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import ServiceClient

# The store's largest page (ListMemories, ListEdges, GetMemories): a larger limit is refused.
PAGE = 1000
OVERLAP = 100
"""Rows each page reads again of the page before: up to so many rows leaving the list (retired)
while the pages are read shift none of the rest out of reach. The pages come oldest first, so
rows written meanwhile come after them."""


async def all_rows(
    store: ServiceClient, request: store_pb2.ListMemoriesRequest, timeout_s: float
) -> list[common_pb2.Memory]:
    """Every row a list request matches, oldest first, in overlapping pages (its order, limit
    and offset are ignored)."""
    rows: dict[str, common_pb2.Memory] = {}
    page = store_pb2.ListMemoriesRequest()
    page.CopyFrom(request)
    page.limit, page.order, page.offset = PAGE, "oldest", 0
    while True:
        reply = await store.ListMemories(page, timeout=timeout_s)
        for row in reply.memories:
            rows.setdefault(row.id, row)
        if len(reply.memories) < PAGE:
            return list(rows.values())
        page.offset += PAGE - OVERLAP


async def get_many(
    store: ServiceClient, scope: common_pb2.Scope, memory_ids: Sequence[str], timeout_s: float
) -> list[common_pb2.Memory]:
    """The rows with these ids in scope, in the order asked; missing ones are left out."""
    ids = list(dict.fromkeys(memory_ids))
    rows: list[common_pb2.Memory] = []
    for start in range(0, len(ids), PAGE):
        request = store_pb2.GetMemoriesRequest(scope=scope, ids=ids[start : start + PAGE])
        rows.extend((await store.GetMemories(request, timeout=timeout_s)).memories)
    return rows


class StoreClient:
    """Typed store calls over an open channel."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float = 60.0) -> None:
        self._stub = ServiceClient(store_pb2_grpc.StoreStub(channel), "store")
        self._timeout_s = timeout_s

    async def get(self, scope: common_pb2.Scope, memory_id: str) -> common_pb2.Memory:
        """One row in scope; NotFound otherwise."""
        reply = await self._stub.GetMemory(
            store_pb2.GetMemoryRequest(scope=scope, id=memory_id), timeout=self._timeout_s
        )
        return reply.memory

    async def apply(
        self,
        scope: common_pb2.Scope,
        ops: Sequence[store_pb2.Op],
        actor: str,
        reason: str,
        origin: str = "",
    ) -> list[common_pb2.Memory]:
        """Applies ops in one store transaction (origin: the client's write_origin, if any)."""
        reply = await self._stub.Apply(
            store_pb2.ApplyRequest(
                scope=scope, ops=list(ops), actor=actor, reason=reason, origin=origin
            ),
            timeout=self._timeout_s,
        )
        return list(reply.memories)

    async def state(self, prefix: str) -> dict[str, str]:
        """State values under a key prefix."""
        reply = await self._stub.GetState(
            store_pb2.GetStateRequest(prefix=prefix), timeout=self._timeout_s
        )
        return {v.key: v.value_json for v in reply.values}

    async def get_many(
        self, scope: common_pb2.Scope, memory_ids: Sequence[str]
    ) -> list[common_pb2.Memory]:
        """The rows with these ids in scope, in order; missing ones left out."""
        return await get_many(self._stub, scope, memory_ids, self._timeout_s)

    async def read_many(self, reads: Sequence[store_pb2.Read]) -> list[store_pb2.ReadResult]:
        """Independent reads in one round trip, answered in order."""
        reply = await self._stub.ReadMany(
            store_pb2.ReadManyRequest(reads=list(reads)), timeout=self._timeout_s
        )
        return list(reply.results)

    async def list_rows(self, request: store_pb2.ListMemoriesRequest) -> list[common_pb2.Memory]:
        """One page of rows (at most PAGE; use all_rows for every match)."""
        return list((await self.list_page(request)).memories)

    async def list_page(
        self, request: store_pb2.ListMemoriesRequest
    ) -> store_pb2.ListMemoriesResponse:
        """One page of rows with the cursor that reads on past it."""
        return await self._stub.ListMemories(request, timeout=self._timeout_s)

    async def all_rows(self, request: store_pb2.ListMemoriesRequest) -> list[common_pb2.Memory]:
        """Every row a list request matches, page by page."""
        return await all_rows(self._stub, request, self._timeout_s)

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
        reply = await self._stub.VectorSearch(
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
        return list(reply.hits)

    async def claim_lease(
        self, name: str, holder: str, ttl_s: float
    ) -> store_pb2.ClaimLeaseResponse:
        """Claims, renews or (ttl_s 0) releases a named lease for a holder."""
        reply: store_pb2.ClaimLeaseResponse = await self._stub.ClaimLease(
            store_pb2.ClaimLeaseRequest(name=name, holder=holder, ttl_s=ttl_s),
            timeout=self._timeout_s,
        )
        return reply


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
    """The store calls of the slow path: graph edges, pass undo."""

    async def edges(
        self, scope: common_pb2.Scope, include_stale: bool = False
    ) -> list[store_pb2.Edge]:
        """Every live edge of a scope (with stale and ended ones if asked), newest first."""
        edges: list[store_pb2.Edge] = []
        while True:
            reply = await self._stub.ListEdges(
                store_pb2.ListEdgesRequest(
                    scope=scope, limit=PAGE, offset=len(edges), include_stale=include_stale
                ),
                timeout=self._timeout_s,
            )
            edges.extend(reply.edges)
            if not reply.edges or len(edges) >= reply.total:
                return edges

    async def undo_pass(self, pass_id: str, actor: str) -> store_pb2.UndoPassResponse:
        """Reverts one consolidation pass."""
        reply: store_pb2.UndoPassResponse = await self._stub.UndoPass(
            store_pb2.UndoPassRequest(pass_id=pass_id, actor=actor), timeout=self._timeout_s
        )
        return reply



def state_op(key: str, value: object) -> store_pb2.Op:
    """A SetState op holding value as JSON (None removes the key)."""
    text = "" if value is None else json.dumps(value, separators=(",", ":"))
    return store_pb2.Op(set_state=store_pb2.SetStateOp(key=key, value_json=text))


def owner_state_op(
    kind: str, user_id: str, agent_id: str, value: object, if_value: str | None = None
) -> store_pb2.Op:
    """A SetState op of one owner's state key of kind (shared.owner_state), which a caller
    reaching the owner may send; with if_value, it applies only while the key still holds
    that stored value."""
    op = state_op(owner_key(kind, user_id, agent_id), value)
    op.set_state.owner.CopyFrom(common_pb2.Owner(user_id=user_id, agent_id=agent_id))
    if if_value is not None:
        op.set_state.if_value_json = if_value
    return op
