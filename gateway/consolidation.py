"""The ultra routes: digest and undo, the L5 graph views, and the admin maintenance jobs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from gateway.errors import error_extras
from gateway.params import Params, read_body
from gateway.shapes import rfc3339
from gateway.state import CONFIG, CONSOLIDATOR, STORE
from shared.errors import InvalidArgument, PermissionDenied, ServiceError
from shared.layers import layer_name
from shared.pb import common_pb2, consolidator_pb2, store_pb2
from shared.store_client import PAGE

routes = web.RouteTableDef()

NO_SLOW_PATH = "this mode has no slow path; consolidation runs only in ultra"
ADMIN_OFF = "maintenance endpoints are off: restart the server with HYATLAS_ADMIN=on"
PASS_TIMEOUT_S = 11 * 60.0
GRAPH_LIMIT = 500
# The store lists at most this many rows at once: the memory nodes of /api/v1/edges.
MEMORY_NODES = 1000
ZERO_TIME = "0001-01-01T00:00:00Z"
# Report fields the reference leaves out when empty.
_OMIT_EMPTY = ("skipped_owners", "errors")


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(
        body, status=status, headers=headers, dumps=lambda v: json.dumps(v, ensure_ascii=False)
    )


async def _params(request: web.Request) -> Params:
    return Params(request.query, await read_body(request))


def report_json(report: consolidator_pb2.PassReport) -> dict[str, Any]:
    """A pass report with the reference's field names (and ours after them)."""
    body: dict[str, Any] = {
        "facts_in": report.facts_in,
        "owners_run": report.owners_run,
        "owners_unchanged": report.owners_unchanged,
        "skipped_owners": list(report.skipped_owners),
        "clusters_run": report.clusters_run,
        "clusters_pending": report.clusters_pending,
        "merged": report.merged,
        "edges": report.edges,
        "dropped": report.dropped,
        "schemas": report.schemas,
        "cross_schemas": report.cross_schemas,
        "arc": report.arc,
        "pruned_raw": report.pruned_raw,
        "protected_raw": report.protected_raw,
        "duration_ms": report.duration_ms,
        "errors": list(report.errors),
        "pass_id": report.pass_id,
        "dropped_ops": report.dropped_ops,
        "llm_calls": report.llm_calls,
        "failed_calls": report.failed_calls,
        "provider_down": report.provider_down,
    }
    for name in _OMIT_EMPTY:
        if not body[name]:
            del body[name]
    return body


async def _graph_counts(request: web.Request) -> tuple[int, int]:
    stats = await request.app[STORE].GetStats(
        store_pb2.GetStatsRequest(scope=common_pb2.Scope(all_users=True)),
        timeout=request.app[CONFIG].rpc_timeout_s,
    )
    return stats.graph_nodes, stats.graph_edges


async def consolidation_status(request: web.Request) -> dict[str, Any]:
    """The status fields of the slow path: consolidations and last_consolidated."""
    if request.app[CONFIG].mode != "ultra":
        return {"consolidations": -1}
    try:
        reply = await request.app[CONSOLIDATOR].GetDigest(
            consolidator_pb2.GetDigestRequest(), timeout=5.0
        )
    except ServiceError:  # status answers while the consolidator is down or failing
        return {"consolidations": 0}
    fields: dict[str, Any] = {"consolidations": reply.runs}
    if reply.HasField("last"):
        fields["last_consolidated"] = report_json(reply.last)
    return fields


@routes.route("*", "/api/v1/digest")
@error_extras(digest_ok=False)
async def digest(request: web.Request) -> web.Response:
    """GET: passes so far and the last report; POST: runs one pass now and returns its report."""
    config = request.app[CONFIG]
    if config.mode != "ultra":
        return _json({"digest_ok": False, "mode": config.mode, "reason": NO_SLOW_PATH})
    consolidator = request.app[CONSOLIDATOR]
    if request.method == "POST":
        reply = await consolidator.RunPass(
            consolidator_pb2.RunPassRequest(), timeout=PASS_TIMEOUT_S
        )
        if not reply.ran:
            return _json({"digest_ok": False, "reason": reply.reason})
        nodes, edges = await _graph_counts(request)
        return _json(
            {
                "digest_ok": True,
                "report": report_json(reply.report),
                "graph_nodes": nodes,
                "graph_edges": edges,
            }
        )
    state = await consolidator.GetDigest(
        consolidator_pb2.GetDigestRequest(), timeout=config.rpc_timeout_s
    )
    nodes, edges = await _graph_counts(request)
    return _json(
        {
            "digest_ok": True,
            "runs": state.runs,
            "last": report_json(state.last) if state.HasField("last") else None,
            "last_at": rfc3339(state.last_at) if state.last_at else ZERO_TIME,
            "running": state.running,
            "graph_nodes": nodes,
            "graph_edges": edges,
        }
    )


@routes.post("/api/v1/digest/undo")
@routes.post("/api/v1/undo_pass")
async def undo_pass(request: web.Request) -> web.Response:
    """Reverts every change of one consolidation pass: {pass_id}."""
    params = await _params(request)
    pass_id = params.string("pass_id")
    if not pass_id:
        raise InvalidArgument("pass_id is required")
    reply = await request.app[CONSOLIDATOR].RevertPass(
        consolidator_pb2.RevertPassRequest(pass_id=pass_id, actor="api"),
        timeout=request.app[CONFIG].rpc_timeout_s,
    )
    return _json(
        {
            "undone": True,
            "pass_id": reply.pass_id,
            "restored": list(reply.restored_ids),
            "retired": list(reply.undone_ids),
            "edges": list(reply.edge_ids),
        }
    )


# -- the graph ------------------------------------------------------------------------------


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
        reply = await request.app[STORE].ListEdges(
            query, timeout=request.app[CONFIG].rpc_timeout_s
        )
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


@routes.route("*", "/api/v1/graph")
async def graph(request: web.Request) -> web.Response:
    """One node's neighbours, and the size of the owner's graph."""
    params = await _params(request)
    node = params.string("node")
    edges, _ = await _edges(request, _owner_scope(params), None)
    key = node_id(node)
    neighbors = []
    for edge in edges:
        if node_id(edge.subject) == key:
            neighbors.append({"label": edge.object, "relation": edge.relation, "incoming": False})
        elif node_id(edge.object) == key:
            neighbors.append({"label": edge.subject, "relation": edge.relation, "incoming": True})
    return _json(
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
    return _json(
        {
            "nodes": nodes_json(edges),
            "relations": [edge_json(e) for e in edges],
            "as_of": int(as_of),
            "total": total,
        }
    )


@routes.get("/api/v1/edges")
async def edges_view(request: web.Request) -> web.Response:
    """The L5 relations with their evidence turns, and links between the newest n live memories.

    co_session links each memory to the next one of its session (a chain per session, oldest
    first); semantic links each memory to its k_semantic nearest among those memories by their
    stored vectors. Raw turns (L2) are left out of both; memory nodes have type "memory".
    """
    params = Params(request.query, {})
    limit = params.integer("n", GRAPH_LIMIT, lo=1, hi=100_000)
    k = params.integer("k_semantic", 3, lo=0, hi=50)
    scope = _owner_scope(params)
    edges, total = await _edges(request, scope, limit)
    timeout = request.app[CONFIG].rpc_timeout_s
    listed = await request.app[STORE].ListMemories(
        store_pb2.ListMemoriesRequest(
            scope=scope, exclude_layers=[common_pb2.L2_RAW], limit=min(limit, MEMORY_NODES)
        ),
        timeout=timeout,
    )
    memories = list(listed.memories)
    sessions: dict[str, list[common_pb2.Memory]] = {}
    for memory in reversed(memories):  # the store lists newest first (ties by write order)
        if memory.owner.session_id:
            sessions.setdefault(memory.owner.session_id, []).append(memory)
    co_session = [
        {"from": a.id, "to": b.id, "relation": "co_session", "weight": 1.0, "session_id": sid}
        for sid, rows in sessions.items()
        for a, b in zip(rows, rows[1:], strict=False)
    ]
    semantic: list[dict[str, Any]] = []
    if k and len(memories) > 1:
        reply = await request.app[STORE].Neighbours(
            store_pb2.NeighboursRequest(scope=scope, ids=[m.id for m in memories], k=k),
            timeout=timeout,
        )
        semantic = [
            {
                "from": link.from_id,
                "to": link.to_id,
                "relation": "semantic",
                "weight": round(link.score, 4),
            }
            for link in reply.links
        ]
    memory_nodes = [
        {
            "id": m.id,
            "label": m.content[:80],
            "type": "memory",
            "layer": layer_name(m.layer),
            **_owner_fields(m.owner),
        }
        for m in memories
    ]
    return _json(
        {
            "nodes": nodes_json(edges) + memory_nodes,
            "knowledge": [edge_json(e) for e in edges],
            "co_session": co_session,
            "semantic": semantic,
            "total_edges": total,
        }
    )


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
    return _json(
        {
            "nodes": nodes,
            "edges": [edge_json(e) for e in edges],
            "memory": {"facts": len(facts), "turns": len(turns)},
            "stats": {"node_count": len(nodes), "edge_count": total},
        }
    )


# -- admin ------------------------------------------------------------------------------------


async def _admin_params(request: web.Request) -> Params:
    if not request.app[CONFIG].admin:
        raise PermissionDenied(ADMIN_OFF)
    if request.method != "POST":
        raise web.HTTPMethodNotAllowed(request.method, ["POST"])
    return await _params(request)


@routes.route("*", "/api/v1/admin/compact_raw")
async def compact_raw(request: web.Request) -> web.Response:
    """Caps raw turns (USER/ASSISTANT only, 4000 bytes a message, 12000 a turn); dry run first."""
    params = await _admin_params(request)
    reply = await request.app[CONSOLIDATOR].CompactRaw(
        consolidator_pb2.CompactRawRequest(dry_run=params.boolean("dry_run", True)),
        timeout=PASS_TIMEOUT_S,
    )
    return _json(
        {
            "dry_run": reply.dry_run,
            "rows_checked": reply.rows_checked,
            "rows_changed": reply.rows_changed,
            "bytes_before": reply.bytes_before,
            "bytes_after": reply.bytes_after,
            "sample": list(reply.sample),
            "rows_rewritten": reply.rows_rewritten,
        }
    )


@routes.route("*", "/api/v1/admin/dedupe_facts")
async def dedupe_facts(request: web.Request) -> web.Response:
    """Supersedes near-duplicate live facts of each person by the newer one; dry run first."""
    params = await _admin_params(request)
    threshold = params.number("threshold", lo=0.0, hi=1.0)
    reply = await request.app[CONSOLIDATOR].DedupeFacts(
        consolidator_pb2.DedupeFactsRequest(
            dry_run=params.boolean("dry_run", True), threshold=threshold or 0.0
        ),
        timeout=PASS_TIMEOUT_S,
    )
    return _json(
        {
            "dry_run": reply.dry_run,
            "threshold": reply.threshold,
            "owners": reply.owners,
            "facts": reply.facts,
            "duplicates": reply.duplicates,
            "sample": list(reply.sample),
            "rows_superseded": reply.rows_superseded,
        }
    )
