"""The L5 graph views: one node's neighbours, the graph as of a time, edges, the starmap feed."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from aiohttp import web

from gateway.params import Params
from gateway.respond import json_response, request_params, rpc_timeout
from gateway.state import STORE
from shared.layers import layer_name
from shared.pb import common_pb2, store_pb2
from shared.store_client import PAGE

GRAPH_LIMIT = 500
# The store lists at most this many rows at once: the memory nodes of /api/v1/edges.
MEMORY_NODES = 1000

routes = web.RouteTableDef()


def _owner_scope(params: Params) -> common_pb2.Scope:
    """user_id / agent_id; "all" or empty means no owner filter."""
    user = params.string("user_id")
    agent = params.string("agent_id")
    agent = "" if agent == "all" else agent
    if not user or user == "all":
        return common_pb2.Scope(all_users=True, agent_id=agent)
    return common_pb2.Scope(user_id=user, agent_id=agent)


async def _edges(
    request: web.Request,
    scope: common_pb2.Scope,
    limit: int | None,
    as_of: float | None = None,
) -> tuple[list[store_pb2.Edge], int]:
    """Up to limit edges (None: all of them), newest first, page by page; and how many match."""
    edges: list[store_pb2.Edge] = []
    total = 0
    while limit is None or len(edges) < limit:
        page = PAGE if limit is None else min(PAGE, limit - len(edges))
        query = store_pb2.ListEdgesRequest(scope=scope, limit=page, offset=len(edges))
        if as_of is not None:
            query.as_of = as_of
        reply = await request.app[STORE].ListEdges(query, timeout=rpc_timeout(request))
        edges.extend(reply.edges)
        total = reply.total
        if not reply.edges or len(edges) >= total:
            break
    return edges, total


def node_id(label: str) -> str:
    """An entity's node id: its name, case-folded and trimmed."""
    return " ".join(label.casefold().split())


def _owner_fields(owner: common_pb2.Owner) -> dict[str, str]:
    fields = {}
    if owner.user_id:
        fields["user_id"] = owner.user_id
    if owner.agent_id:
        fields["agent_id"] = owner.agent_id
    return fields


def edge_json(edge: store_pb2.Edge) -> dict[str, Any]:
    """An edge in the reference's shape (times in unix seconds), with its evidence."""
    body: dict[str, Any] = {
        "id": edge.id,
        "from": node_id(edge.subject),
        "to": node_id(edge.object),
        "relation": edge.relation,
        "weight": edge.weight,
        **_owner_fields(edge.owner),
        "source": edge.source_ids[0] if edge.source_ids else "",
        "sources": list(edge.source_ids),
        "facts": list(edge.fact_ids),
        "memory_id": edge.memory_id,
        "recorded_at": int(edge.recorded_at),
    }
    for name in ("valid_from", "valid_to", "invalidated_at"):
        if edge.HasField(name):
            body[name] = int(getattr(edge, name))
    if edge.stale:
        body["stale"] = True
    return body


def nodes_json(edges: Iterable[store_pb2.Edge]) -> list[dict[str, Any]]:
    """The entities the edges join, each once."""
    nodes: dict[str, dict[str, Any]] = {}
    for edge in edges:
        for label in (edge.subject, edge.object):
            nodes.setdefault(
                node_id(label),
                {
                    "id": node_id(label),
                    "label": label,
                    "type": "entity",
                    **_owner_fields(edge.owner),
                },
            )
    return list(nodes.values())


@routes.get("/api/v1/graph")
@routes.post("/api/v1/graph")
async def graph(request: web.Request) -> web.Response:
    """One node's neighbours, and the size of the owner's graph."""
    params = await request_params(request)
    node = params.string("node")
    edges, _ = await _edges(request, _owner_scope(params), None)
    key = node_id(node)
    neighbors = []
    for edge in edges:
        if node_id(edge.subject) == key:
            neighbors.append({"label": edge.object, "relation": edge.relation, "incoming": False})
        elif node_id(edge.object) == key:
            neighbors.append({"label": edge.subject, "relation": edge.relation, "incoming": True})
    return json_response(
        {
            "node": node,
            "neighbors": neighbors,
            "node_count": len(nodes_json(edges)),
            "edge_count": len(edges),
            "extract_err": "",
        }
    )


@routes.get("/api/v1/graph-as-of")
async def graph_as_of(request: web.Request) -> web.Response:
    """The graph as it stood at ts: edges recorded by then and not yet invalidated."""
    params = Params(request.query, {})
    ts = params.timestamp("ts")
    as_of = time.time() if ts is None else ts
    limit = params.integer("n", GRAPH_LIMIT, lo=1, hi=100_000)
    edges, total = await _edges(request, _owner_scope(params), limit, as_of)
    return json_response(
        {
            "nodes": nodes_json(edges),
            "relations": [edge_json(e) for e in edges],
            "as_of": int(as_of),
            "total": total,
        }
    )


@routes.get("/api/v1/edges")
async def edges_view(request: web.Request) -> web.Response:
    """The L5 relations with their evidence turns, and links between the newest n live memories
    (at most MEMORY_NODES; total_memories says how many there are).

    co_session links each memory to the next one of its session (a chain per session, oldest
    first); semantic links each memory to its k_semantic nearest among those memories by their
    stored vectors. Raw turns (L2) are left out of both; memory nodes have type "memory".
    """
    params = Params(request.query, {})
    limit = params.integer("n", GRAPH_LIMIT, lo=1, hi=100_000)
    k = params.integer("k_semantic", 3, lo=0, hi=50)
    scope = _owner_scope(params)
    edges, total = await _edges(request, scope, limit)
    listed = await request.app[STORE].ListMemories(
        store_pb2.ListMemoriesRequest(
            scope=scope, exclude_layers=[common_pb2.L2_RAW], limit=min(limit, MEMORY_NODES)
        ),
        timeout=rpc_timeout(request),
    )
    memories = list(listed.memories)
    return json_response(
        {
            "nodes": nodes_json(edges) + [_memory_node(m) for m in memories],
            "knowledge": [edge_json(e) for e in edges],
            "co_session": _co_session(memories),
            "semantic": await _semantic(request, scope, memories, k),
            "total_edges": total,
            # The memory nodes are the newest min(n, MEMORY_NODES) of these: said, not hidden.
            "total_memories": listed.total,
        }
    )


def _memory_node(memory: common_pb2.Memory) -> dict[str, Any]:
    return {
        "id": memory.id,
        "label": memory.content[:80],
        "type": "memory",
        "layer": layer_name(memory.layer),
        **_owner_fields(memory.owner),
    }


def _co_session(memories: Sequence[common_pb2.Memory]) -> list[dict[str, Any]]:
    """Links from each memory to the next of its session, oldest first."""
    sessions: dict[str, list[common_pb2.Memory]] = {}
    for memory in reversed(memories):  # the store lists newest first (ties by write order)
        if memory.owner.session_id:
            sessions.setdefault(memory.owner.session_id, []).append(memory)
    return [
        {"from": a.id, "to": b.id, "relation": "co_session", "weight": 1.0, "session_id": sid}
        for sid, rows in sessions.items()
        for a, b in zip(rows, rows[1:], strict=False)
    ]


async def _semantic(
    request: web.Request, scope: common_pb2.Scope, memories: Sequence[common_pb2.Memory], k: int
) -> list[dict[str, Any]]:
    """Links from each memory to its k nearest among the others, by their stored vectors."""
    if not k or len(memories) < 2:
        return []
    reply = await request.app[STORE].Neighbours(
        store_pb2.NeighboursRequest(scope=scope, ids=[m.id for m in memories], k=k),
        timeout=rpc_timeout(request),
    )
    return [
        {
            "from": link.from_id,
            "to": link.to_id,
            "relation": "semantic",
            "weight": round(link.score, 4),
        }
        for link in reply.links
    ]


@routes.get("/api/v1/learning/graph")
async def learning_graph(request: web.Request) -> web.Response:
    """The starmap feed: nodes, edges, the memory they rest on, and counts."""
    params = Params(request.query, {})
    limit = params.integer("n", GRAPH_LIMIT, lo=1, hi=100_000)
    params.integer("k_semantic", 2, lo=0, hi=50)
    edges, total = await _edges(request, _owner_scope(params), limit)
    nodes = nodes_json(edges)
    facts = {f for e in edges for f in e.fact_ids}
    turns = {t for e in edges for t in e.source_ids}
    return json_response(
        {
            "nodes": nodes,
            "edges": [edge_json(e) for e in edges],
            "memory": {"facts": len(facts), "turns": len(turns)},
            "stats": {"node_count": len(nodes), "edge_count": total},
        }
    )
