"""The /api/v1 routes: REST parameters in, store and search calls, the reference's JSON out."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from typing import Any

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.consolidation import consolidation_status
from gateway.errors import Handler, error_extras
from gateway.params import Params, read_body
from gateway.readiness import is_ready, service_states, wait_for_store
from gateway.shapes import layer_counts, list_items, rfc3339, search_response
from gateway.state import CONFIG, COUNTERS, EXTRACTOR, SEARCH, STORE
from shared.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ServiceError,
    Unimplemented,
)
from shared.layers import parse_layer
from shared.pb import common_pb2, extractor_pb2, search_pb2, store_pb2

log = logging.getLogger(__name__)

VERSION = "5.0.0-py"
DEFAULT_USER = "default"
SEARCH_LIMIT_DEFAULT = 5
LIST_LIMIT_DEFAULT = 20
LIMIT_MAX = 1000
INT32_MIN = -(2**31)
# metadata.write_origin values the Hermes plugin sets; such writes are audited as the plugin's.
PLUGIN_ORIGINS = frozenset({"plugin", "memory_tool", "sync_turn"})
# The reference reads every reader it does not know as hybrid; hybrid_v2 is one it once had.
READER_ALIASES = {"hybrid_v2": "hybrid"}
UNSCOPED_DELETE = (
    "unscoped delete refused: pass layer/user_id/agent_id/id, or all=true to wipe the entire store"
)

routes = web.RouteTableDef()


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(
        body, status=status, headers=headers, dumps=lambda v: json.dumps(v, ensure_ascii=False)
    )


async def _params(request: web.Request, *, query_wins: bool = False) -> Params:
    return Params(request.query, await read_body(request), query_wins=query_wins)


def _scope(user_id: str, agent_id: str = "") -> common_pb2.Scope:
    return common_pb2.Scope(user_id=user_id or DEFAULT_USER, agent_id=agent_id)


def _all_users() -> common_pb2.Scope:
    return common_pb2.Scope(all_users=True)


def _layers(text: str) -> list[Any]:
    """The layer filter a `layer` parameter names; empty or "*" means every layer."""
    return [] if text in ("", "*") else [parse_layer(text)]


def _timeout(request: web.Request) -> float:
    return request.app[CONFIG].rpc_timeout_s


def llm_state(config: GatewayConfig) -> str:
    """The status `llm` field from the settings alone (when the extractor cannot say)."""
    if config.mode == "lite":
        return "unused"
    if config.llm_configured:
        return "ok"
    return "awaiting_key" if config.llm_endpoint else "unconfigured"


def mode_detail(config: GatewayConfig) -> str:
    """What the mode does, in words."""
    if config.mode == "lite":
        return "lite: raw writes and search only (L2); no LLM call at all"
    if config.mode == "pro":
        return (
            "pro: one LLM extraction per write (L1, L2, L3, L4, L7, L8) plus episode summaries; "
            "no consolidation"
        )
    detail = (
        "ultra: one LLM extraction per write plus the periodic consolidation pass "
        "(all eight layers; L5 and L6 come from consolidation)"
    )
    if not config.consolidate_graph:
        detail += "; HYATLAS_CONSOLIDATE_GRAPH=off: no L5 graph and no arc"
    return detail


def extract_sync(config: GatewayConfig) -> str:
    """The status `extract_sync` field."""
    if config.mode == "lite":
        return "none (lite mode)"
    if config.sync_extract:
        return "blocking (a write waits for its extraction; HYATLAS_SYNC_EXTRACT)"
    return "background (a write returns pending; extraction runs behind it; HYATLAS_SYNC_EXTRACT)"


def extraction_status(config: GatewayConfig) -> str:
    """The status a new raw row starts with (a key may still arrive for a pending one)."""
    if config.mode == "lite":
        return "skipped"
    return "pending" if config.llm_endpoint else "unconfigured"


async def _llm_status(request: web.Request) -> extractor_pb2.GetLlmStatusResponse | None:
    """What the extractor says about the LLM, or None when it cannot be asked."""
    config = request.app[CONFIG]
    if config.mode == "lite":
        return None
    try:
        return await request.app[EXTRACTOR].GetLlmStatus(
            extractor_pb2.GetLlmStatusRequest(), timeout=min(5.0, _timeout(request))
        )
    except ServiceError as exc:
        log.warning("extractor status unavailable: %s", exc.message)
        return None


async def _extract(request: web.Request, scope: common_pb2.Scope, memory_id: str) -> str:
    """Hands a new raw row to the extractor; if it cannot be reached, catch-up takes the row."""
    config = request.app[CONFIG]
    wait = config.sync_extract
    # A waiting write may see a primary and a fallback round, and one retry of each.
    timeout = 2 * config.extract_timeout_s + 30.0 if wait else _timeout(request)
    try:
        reply = await request.app[EXTRACTOR].ExtractMemory(
            extractor_pb2.ExtractMemoryRequest(scope=scope, id=memory_id, wait=wait),
            timeout=timeout,
        )
    except ServiceError as exc:
        log.warning("extraction of %s not started (%s); catch-up will take it", memory_id, exc)
        return "pending"
    return reply.extraction_status


@routes.route("*", "/api/v1/status")
async def status(request: web.Request) -> web.Response:
    """Server, model, mode and per-layer counts; writes and searches count since this start."""
    config = request.app[CONFIG]
    stats = await request.app[STORE].GetStats(
        store_pb2.GetStatsRequest(scope=_all_users()), timeout=_timeout(request)
    )
    counters = request.app[COUNTERS]
    services = await service_states(request.app)
    llm = await _llm_status(request)
    if llm is not None:
        state, pipeline = llm.llm, llm.write_pipeline
    else:
        state = llm_state(config)
        pipeline = "ok" if config.mode == "lite" else "degraded: the extractor is unavailable"
    extras: dict[str, Any] = {}
    if llm is not None:
        extras = {
            "dropped_ops": llm.dropped_ops,
            "refused_forgotten": llm.refused_forgotten,
            "extracting": llm.in_flight,
        }
    return _json(
        {
            "status": "ok",
            "ready": is_ready(services, config.mode),
            "services": services,
            "version": VERSION,
            "vdb": "ok",
            "embed": stats.model_id,
            "embed_dims": stats.ndim,
            "llm": state,
            "llm_model": config.llm_model,
            "llm_base": config.llm_base,
            "mode": config.mode,
            "mode_detail": mode_detail(config),
            "uses_llm": config.mode != "lite",
            "extract_sync": extract_sync(config),
            "write_pipeline": pipeline,
            "writes": counters.writes,
            "searches": counters.searches,
            "layers": layer_counts(stats.layers),
            "graph_nodes": stats.graph_nodes,
            "graph_edges": stats.graph_edges,
            "unextracted": 0 if config.mode == "lite" else stats.unextracted,
            **await consolidation_status(request),
            "vdb_points": stats.total,
            "data_dir": stats.data_dir or str(config.data_dir),
            **extras,
        }
    )


@routes.route("*", "/api/v1/metrics")
async def metrics(request: web.Request) -> web.Response:
    """Live rows per layer and in total, and the graph's size."""
    stats = await request.app[STORE].GetStats(
        store_pb2.GetStatsRequest(scope=_all_users()), timeout=_timeout(request)
    )
    return _json(
        {
            "layers": layer_counts(stats.layers),
            "total": stats.total,
            "graph_nodes": stats.graph_nodes,
            "graph_edges": stats.graph_edges,
        }
    )


@routes.post("/api/v1/add")
@error_extras(success=False)
async def add(request: web.Request) -> web.Response:
    """Stores one raw (L2) row for the owner and reports how its extraction will go."""
    config = request.app[CONFIG]
    params = await _params(request)
    text = params.string("text", strip=False)
    if not text.strip():
        text = params.string("data", strip=False)
    if not text.strip():
        raise InvalidArgument("text required")
    user_id = params.string("user_id")
    agent_id = params.string("agent_id")
    metadata = params.obj("metadata")
    session_id = params.string("session_id")
    if not session_id and isinstance(metadata.get("session_id"), str):
        session_id = metadata["session_id"].strip()
    event_at = params.timestamp("event_at")
    origin = metadata.get("write_origin")
    actor = "plugin" if isinstance(origin, str) and origin in PLUGIN_ORIGINS else "api"
    status_ = extraction_status(config)

    owner = common_pb2.Owner(
        user_id=user_id or DEFAULT_USER, agent_id=agent_id, session_id=session_id
    )
    row = store_pb2.NewMemory(
        owner=owner,
        layer=common_pb2.L2_RAW,
        content=text,
        metadata_json=json.dumps(metadata, ensure_ascii=False),
        extraction_status=status_,
        write_mode=config.mode,
    )
    if event_at is not None:
        row.event_at = event_at
    await wait_for_store(request.app)
    reply = await request.app[STORE].Apply(
        store_pb2.ApplyRequest(
            scope=_scope(owner.user_id, agent_id),
            ops=[store_pb2.Op(insert=row)],
            actor=actor,
            reason="add",
        ),
        timeout=_timeout(request),
    )
    request.app[COUNTERS].writes += 1
    memory_id = reply.memories[0].id
    if status_ == "pending":
        status_ = await _extract(request, _scope(owner.user_id, agent_id), memory_id)
    return _json({"success": True, "memory_id": memory_id, "extraction_status": status_})


def _reader(text: str) -> str:
    """The reader name for the search service, which validates it (unknown names are a 400)."""
    key = text.lower()
    return READER_ALIASES.get(key, key)


@routes.route("GET", "/api/v1/search")
@routes.post("/api/v1/search")
async def search(request: web.Request) -> web.Response:
    """Ranked memories of one owner in the reference's channels."""
    params = await _params(request)
    query = params.string("query")
    if not query:
        raise InvalidArgument("query required")
    limit = params.integer("limit", 0, lo=INT32_MIN)
    limit = SEARCH_LIMIT_DEFAULT if limit <= 0 else min(limit, LIMIT_MAX)
    layer = params.string("layer")
    user_ids = params.strings("user_ids")
    agent_ids = params.strings("agent_ids")
    user_id = params.string("user_id") or (user_ids[0] if user_ids else "")
    agent_id = params.string("agent_id") or (agent_ids[0] if agent_ids else "")
    min_score = params.number("min_score", lo=0.0, hi=1.0)
    reference_time = params.timestamp("reference_time")

    req = search_pb2.SearchMemoriesRequest(
        scope=_scope(user_id, agent_id),
        query=query,
        limit=limit,
        layers=_layers(layer),
        reader=_reader(params.string("reader")),
        session_id=params.string("session_id"),
        # A debugging option: ranking stages to switch off for this one search.
        skip_stages=params.strings("skip_stages"),
    )
    if min_score is not None:
        req.min_score = min_score
    if reference_time is not None:
        req.reference_time = reference_time
    reply = await request.app[SEARCH].SearchMemories(req, timeout=_timeout(request))
    request.app[COUNTERS].searches += 1
    return _json(search_response(reply))


@routes.get("/api/v1/list")
@routes.post("/api/v1/list")
async def list_memories(request: web.Request) -> web.Response:
    """One owner's rows, newest first, with paging and per-layer counts."""
    params = await _params(request)
    limit = params.integer("limit", 0, lo=INT32_MIN)
    limit = LIST_LIMIT_DEFAULT if limit <= 0 else min(limit, LIMIT_MAX)
    offset = params.integer("offset", 0)
    layer = params.string("layer")
    layers = _layers(layer)
    include_raw = params.boolean("include_raw", True)
    include_superseded = params.boolean("include_superseded", False)
    scope = _scope(params.string("user_id"), params.string("agent_id"))

    store = request.app[STORE]
    listed, stats = await asyncio.gather(
        store.ListMemories(
            store_pb2.ListMemoriesRequest(
                scope=scope,
                layers=layers,
                include_superseded=include_superseded,
                limit=limit,
                offset=offset,
                exclude_layers=[] if include_raw or layers else [common_pb2.L2_RAW],
            ),
            timeout=_timeout(request),
        ),
        store.GetStats(store_pb2.GetStatsRequest(scope=scope), timeout=_timeout(request)),
    )
    return _json(
        {
            "total": listed.total,
            "offset": offset,
            "limit": limit,
            "memories": list_items(listed.memories),
            "layers": layer_counts(stats.layers),
            "graph_nodes": stats.graph_nodes,
            "graph_edges": stats.graph_edges,
        }
    )


@routes.route("*", "/api/v1/delete_all")
@error_extras(deleted_count=0)
async def delete_all(request: web.Request) -> web.Response:
    """Deletes one of the caller's rows by id, or (with HYATLAS_ADMIN=on) rows in a scope."""
    if request.method not in ("POST", "DELETE"):
        return _json(
            {"deleted_count": 0, "error": "method not allowed: use POST or DELETE"},
            status=405,
            headers={"Allow": "POST, DELETE"},
        )
    params = await _params(request, query_wins=True)
    memory_id = params.string("id")
    user_id = params.string("user_id")
    agent_id = params.string("agent_id")
    if memory_id:
        await _delete_one(request, memory_id, _scope(user_id, agent_id))
        return _json({"deleted_count": 1, "error": ""})

    layer = params.string("layer")
    layers = _layers(layer)
    wipe = params.boolean("all", False) or params.string("confirm") == "wipe-all"
    if not (layers or user_id or agent_id or wipe):
        raise InvalidArgument(UNSCOPED_DELETE)
    if not request.app[CONFIG].admin:
        raise PermissionDenied(
            "bulk delete is off: restart the server with HYATLAS_ADMIN=on "
            "(deleting one memory by id needs no switch)"
        )
    scope = (
        common_pb2.Scope(user_id=user_id, agent_id=agent_id)
        if user_id
        else common_pb2.Scope(all_users=True, agent_id=agent_id)
    )
    reply = await request.app[STORE].DeleteMemories(
        store_pb2.DeleteMemoriesRequest(scope=scope, layers=layers, actor="api"),
        timeout=_timeout(request),
    )
    return _json({"deleted_count": reply.deleted, "error": ""})


async def _delete_one(request: web.Request, memory_id: str, scope: common_pb2.Scope) -> None:
    """Erases one row, but only when it lies in the caller's scope."""
    store = request.app[STORE]
    timeout = _timeout(request)
    try:
        # The store checks the scope in the delete's own transaction.
        await store.Apply(
            store_pb2.ApplyRequest(
                scope=scope,
                ops=[store_pb2.Op(delete=store_pb2.DeleteOp(id=memory_id))],
                actor="api",
                reason="delete_all by id",
            ),
            timeout=timeout,
        )
    except (NotFound, PermissionDenied):
        # Another owner's row is reported exactly like a missing one, so ids do not leak.
        raise NotFound(f"memory {memory_id!r} not found") from None


@routes.post("/api/v1/flush")
async def flush(request: web.Request) -> web.Response:
    """Persists the store's vector indexes now (before a hard stop)."""
    reply = await request.app[STORE].Flush(store_pb2.FlushRequest(), timeout=_timeout(request))
    return _json({"flushed": True, "vectors": reply.vectors})


@routes.post("/api/v1/reprocess")
async def reprocess(request: web.Request) -> web.Response:
    """Re-extracts the given raw rows, or up to max unextracted ones, oldest first."""
    config = request.app[CONFIG]
    params = await _params(request)
    ids = params.strings("ids")
    most = params.integer("max", 0, lo=INT32_MIN)
    most = 200 if most <= 0 else most
    if config.mode == "lite":
        if ids:
            skipped = len(ids)
        else:
            stats = await request.app[STORE].GetStats(
                store_pb2.GetStatsRequest(scope=_all_users()), timeout=_timeout(request)
            )
            skipped = min(most, int(stats.layers.get("l2_raw", 0)))
        return _json(
            {
                "reprocessed": 0,
                "failed": 0,
                "skipped": skipped,
                "note": "mode is lite; extraction is disabled, nothing to reprocess",
            }
        )
    reply = await request.app[EXTRACTOR].Reprocess(
        extractor_pb2.ReprocessRequest(ids=ids, max=most),
        timeout=max(_timeout(request), (2 * config.extract_timeout_s + 30.0) * 4),
    )
    return _json(
        {"reprocessed": reply.reprocessed, "failed": reply.failed, "skipped": reply.skipped}
    )


def _loopback(request: web.Request) -> bool:
    """Whether the client connected from this machine, not through a proxy."""
    if "Forwarded" in request.headers or "X-Forwarded-For" in request.headers:
        return False
    remote = request.remote or ""
    try:
        return ipaddress.ip_address(remote.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


@routes.post("/api/v1/llm/key")
async def llm_key(request: web.Request) -> web.Response:
    """Hands an LLM key to the extractor (kept in memory only); loopback clients only."""
    if not _loopback(request):
        raise PermissionDenied("the LLM key is accepted only from this machine")
    config = request.app[CONFIG]
    if config.mode == "lite":
        raise InvalidArgument("mode is lite; no LLM is used, so no key is needed")
    params = await _params(request)
    key = params.string("key") or params.string("llm_key")
    if not key:
        raise InvalidArgument("key required")
    reply = await request.app[EXTRACTOR].SetLlmKey(
        extractor_pb2.SetLlmKeyRequest(key=key), timeout=_timeout(request)
    )
    return _json({"ok": True, "llm": reply.llm})


@routes.post("/api/v1/forget")
async def forget(request: web.Request) -> web.Response:
    """Retires the owner's rows holding a value (by text or id) and tombstones the value."""
    params = await _params(request)
    text = params.string("text") or params.string("old_text")
    memory_id = params.string("id") or params.string("memory_id")
    if bool(text) == bool(memory_id):
        raise InvalidArgument("pass exactly one of text and id")
    metadata = params.obj("metadata")
    origin = metadata.get("write_origin") or params.string("source") or params.string("origin")
    actor = "plugin" if isinstance(origin, str) and origin in PLUGIN_ORIGINS else "api"
    reply = await request.app[EXTRACTOR].ForgetMemories(
        extractor_pb2.ForgetMemoriesRequest(
            scope=_scope(params.string("user_id"), params.string("agent_id")),
            text=text,
            id=memory_id,
            reason=params.string("reason"),
            actor=actor,
            memory_tool=origin == "memory_tool",
        ),
        timeout=_timeout(request),
    )
    return _json(
        {
            "forgotten": len(reply.memories),
            "memories": list_items(reply.memories),
            "evidence_ids": list(reply.evidence_ids),
        }
    )


@routes.post("/api/v1/restore")
async def restore(request: web.Request) -> web.Response:
    """Brings one of the owner's retired rows back; what replaced it stays as it is."""
    params = await _params(request)
    memory_id = params.string("id") or params.string("memory_id")
    if not memory_id:
        raise InvalidArgument("id required")
    scope = _scope(params.string("user_id"), params.string("agent_id"))
    store = request.app[STORE]
    try:
        # The store decides in the same transaction whether there is anything to restore.
        reply = await store.Apply(
            store_pb2.ApplyRequest(
                scope=scope,
                ops=[store_pb2.Op(restore=store_pb2.RestoreOp(id=memory_id))],
                actor="api",
                reason=params.string("reason") or "restore",
            ),
            timeout=_timeout(request),
        )
    except Conflict:  # already live: nothing to do, the row as it is
        current = await store.GetMemory(
            store_pb2.GetMemoryRequest(scope=scope, id=memory_id), timeout=_timeout(request)
        )
        return _json({"restored": False, "memory": list_items([current.memory])[0]})
    return _json({"restored": True, "memory": list_items(reply.memories)[0]})


@routes.get("/api/v1/history")
@routes.post("/api/v1/history")
async def history(request: web.Request) -> web.Response:
    """The audit trail of one of the owner's rows, oldest first."""
    params = await _params(request)
    memory_id = params.string("id") or params.string("memory_id")
    if not memory_id:
        raise InvalidArgument("id required")
    scope = _scope(params.string("user_id"), params.string("agent_id"))
    reply = await request.app[STORE].GetHistory(
        store_pb2.GetHistoryRequest(scope=scope, id=memory_id), timeout=_timeout(request)
    )
    return _json(
        {
            "memory_id": memory_id,
            "history": [
                {
                    "seq": entry.seq,
                    "at": rfc3339(entry.at),
                    "actor": entry.actor,
                    "action": entry.action,
                    "reason": entry.reason,
                    "before": json.loads(entry.before_json) if entry.before_json else None,
                    "after": json.loads(entry.after_json) if entry.after_json else None,
                }
                for entry in reply.entries
            ],
        }
    )


MAX_FEEDBACK_IDS = 100


@routes.post("/api/v1/feedback")
async def feedback(request: web.Request) -> web.Response:
    """A client reports which recalled memories a reply used; search ranks them a little higher.

    Each id must be one of the owner's rows (else 404, nothing counted). With
    HYATLAS_USAGE_LEARNING off nothing is recorded.
    """
    params = await _params(request)
    memory_ids = list(dict.fromkeys(params.strings("memory_ids") or params.strings("ids")))
    if not memory_ids:
        raise InvalidArgument("memory_ids required")
    if len(memory_ids) > MAX_FEEDBACK_IDS:
        raise InvalidArgument(f"at most {MAX_FEEDBACK_IDS} memory_ids per call")
    if not request.app[CONFIG].usage_learning:
        return _json({"success": True, "recorded": 0, "usage_learning": False})
    scope = _scope(params.string("user_id"), params.string("agent_id"))
    # One transaction that adds to hits: concurrent feedback never loses a count, and an id
    # outside the owner's rows refuses the whole call (404, nothing counted).
    ops = [
        store_pb2.Op(update=store_pb2.UpdateOp(id=memory_id, hits_delta=1))
        for memory_id in memory_ids
    ]
    await request.app[STORE].Apply(
        store_pb2.ApplyRequest(scope=scope, ops=ops, actor="api", reason="feedback"),
        timeout=_timeout(request),
    )
    return _json({"success": True, "recorded": len(ops), "usage_learning": True})


NOT_YET: dict[str, str] = {
    "/api/v1/export": "JSONL export comes in a later issue",
    "/api/v1/import": "JSONL import comes in a later issue",
}


def _not_yet(path: str) -> Handler:
    message = f"{path} is not implemented yet: {NOT_YET[path]}"

    async def handler(request: web.Request) -> web.Response:
        raise Unimplemented(message)

    return handler


def add_placeholder_routes(app: web.Application) -> None:
    """Routes a later issue builds answer 501 and say which one."""
    for path in NOT_YET:
        app.router.add_route("*", path, _not_yet(path))
