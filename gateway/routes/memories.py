"""One owner's rows: add, list, delete, restore, history, and flushing the indexes."""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from gateway import admission
from gateway.config import GatewayConfig
from gateway.errors import error_extras
from gateway.params import check_string
from gateway.readiness import wait_for_store
from gateway.respond import (
    INT32_MIN,
    json_response,
    layer_filter,
    owner_scope,
    request_params,
    rpc_timeout,
    writes,
)
from gateway.shapes import layer_counts, list_items
from gateway.state import CONFIG, COUNTERS, EXTRACTOR, STORE
from gateway.wording import extraction_status
from shared.dates import rfc3339
from shared.errors import Conflict, InvalidArgument, NotFound, PermissionDenied, ServiceError
from shared.layers import PENDING, layer_name
from shared.limits import check_idempotency_key
from shared.pb import common_pb2, extractor_pb2, store_pb2

log = logging.getLogger(__name__)

LIST_LIMIT_DEFAULT = 20
UNSCOPED_DELETE = (
    "unscoped delete refused: pass layer/user_id/agent_id/id, or all=true to wipe the entire store"
)

routes = web.RouteTableDef()


@routes.post("/api/v1/add")
@error_extras(success=False)
@writes
async def add(request: web.Request) -> web.Response:
    """Stores one raw (L2) row for the owner and reports how its extraction will go. A retry
    with the same Idempotency-Key is stored once and answered with the first write's id."""
    config = request.app[CONFIG]
    key = _idempotency_key(request)
    params = await request_params(request)
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
        session_id = check_string("session_id", metadata["session_id"]).strip()
    # The writer's UTC offset goes with the row: extraction reads the turn on the writer's day.
    event_at = params.time_and_offset("event_at")
    origin = metadata.get("write_origin")
    status_ = extraction_status(config)

    scope = owner_scope(user_id, agent_id)
    owner = common_pb2.Owner(
        user_id=scope.user_id, agent_id=scope.agent_id, session_id=session_id
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
        row.event_at, row.utc_offset_minutes = event_at[0], event_at[1] or 0
    await wait_for_store(request.app)
    reply = await request.app[STORE].Apply(
        store_pb2.ApplyRequest(
            scope=scope,
            ops=[store_pb2.Op(insert=row)],
            actor="api",
            origin=origin if isinstance(origin, str) else "",
            reason="add",
            idempotency_key=key,
        ),
        timeout=rpc_timeout(request),
    )
    memory = reply.memories[0]
    if reply.replayed:
        return json_response({
            "success": True, "memory_id": memory.id, "replayed": True,
            "extraction_status": memory.extraction_status or status_,
        })
    request.app[COUNTERS].writes += 1
    memory_id = memory.id
    if status_ == PENDING:
        status_ = await _extract(request, scope, memory_id)
    return json_response({"success": True, "memory_id": memory_id, "extraction_status": status_})


def _idempotency_key(request: web.Request) -> str:
    """The Idempotency-Key header ("" without one); a key no client would send is refused."""
    return check_idempotency_key(request.headers.get("Idempotency-Key", "").strip())


async def _extract(request: web.Request, scope: common_pb2.Scope, memory_id: str) -> str:
    """Hands a new raw row to the extractor; if it cannot be reached, catch-up takes the row."""
    config = request.app[CONFIG]
    wait = config.sync_extract
    if wait:
        admission.leave(request)
    # A waiting write may see a primary and a fallback round, and one retry of each.
    timeout = 2 * config.extract_timeout_s + 30.0 if wait else rpc_timeout(request)
    try:
        reply = await request.app[EXTRACTOR].ExtractMemory(
            extractor_pb2.ExtractMemoryRequest(scope=scope, id=memory_id, wait=wait),
            timeout=timeout,
        )
    except ServiceError as exc:
        log.warning("extraction of %s not started (%s); catch-up will take it", memory_id, exc)
        return PENDING
    return reply.extraction_status


@routes.get("/api/v1/list")
@routes.post("/api/v1/list")
async def list_memories(request: web.Request) -> web.Response:
    """One owner's rows, newest first, with paging and per-layer counts."""
    params = await request_params(request)
    # The store refuses a negative limit or one over its maximum (400), never cuts it.
    limit = params.integer("limit", 0, lo=INT32_MIN) or LIST_LIMIT_DEFAULT
    offset = params.integer("offset", 0)
    before = params.string("before")  # the store's cursor, from a page's next_before
    layer = params.string("layer")
    layers = layer_filter(layer)
    include_raw = params.boolean("include_raw", True)
    include_superseded = params.boolean("include_superseded", False)
    scope = owner_scope(params.string("user_id"), params.string("agent_id"))

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
                cursor=before,
                contains=params.string("contains"),
            ),
            timeout=rpc_timeout(request),
        ),
        store.GetStats(store_pb2.GetStatsRequest(scope=scope), timeout=rpc_timeout(request)),
    )
    return json_response(
        {
            "total": listed.total,
            "offset": offset,
            "limit": limit,
            "memories": list_items(listed.memories),
            "layers": layer_counts(stats.layers),
            "graph_nodes": stats.graph_nodes,
            "graph_edges": stats.graph_edges,
            "next_before": listed.next_cursor,
        }
    )


@routes.route("*", "/api/v1/delete_all")
@error_extras(deleted_count=0)
@writes
async def delete_all(request: web.Request) -> web.Response:
    """Deletes one of the caller's rows by id, or (with HYATLAS_ADMIN=on) rows in a scope."""
    if request.method not in ("POST", "DELETE"):
        return json_response(
            {"deleted_count": 0, "error": "method not allowed: use POST or DELETE"},
            status=405,
            headers={"Allow": "POST, DELETE"},
        )
    params = await request_params(request, query_wins=True)
    memory_id = params.string("id")
    user_id = params.string("user_id")
    agent_id = params.string("agent_id")
    layers = layer_filter(params.string("layer"))
    wipe = params.boolean("all", False) or params.string("confirm") == "wipe-all"
    if memory_id:
        if wipe:
            raise InvalidArgument("id erases one memory: not with all or confirm=wipe-all")
        await _delete_one(request, memory_id, owner_scope(user_id, agent_id), layers,
                          params.string("origin"))
        return json_response({"deleted_count": 1, "error": ""})

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
        timeout=rpc_timeout(request),
    )
    return json_response({"deleted_count": reply.deleted, "error": ""})


async def _delete_one(
    request: web.Request,
    memory_id: str,
    scope: common_pb2.Scope,
    layers: list[int],
    origin: str,
) -> None:
    """Erases one row, but only when it lies in the caller's scope (and the layer named)."""
    store = request.app[STORE]
    timeout = rpc_timeout(request)
    if layers:  # a row never changes layer: checked before the delete, it still holds then
        found = await store.GetMemory(
            store_pb2.GetMemoryRequest(scope=scope, id=memory_id), timeout=timeout
        )
        if found.memory.layer not in layers:
            raise NotFound(f"memory {memory_id!r} not found in layer {layer_name(layers[0])}")
    try:
        # The store checks the scope in the delete's own transaction.
        await store.Apply(
            store_pb2.ApplyRequest(
                scope=scope,
                ops=[store_pb2.Op(delete=store_pb2.DeleteOp(id=memory_id))],
                actor="api",
                origin=origin,
                reason="delete_all by id",
            ),
            timeout=timeout,
        )
    except NotFound:
        # Another owner's row is reported exactly like a missing one, so ids do not leak (an
        # owner the caller's token does not reach is refused with 403, whatever the id).
        raise NotFound(f"memory {memory_id!r} not found") from None


@routes.post("/api/v1/restore")
@writes
async def restore(request: web.Request) -> web.Response:
    """Brings one of the owner's retired rows back (409 while what replaced it is live, or
    while the evidence of a derived row is gone). A forgotten row's value is taken off the
    tombstones its forget left."""
    params = await request_params(request)
    memory_id = params.string("id") or params.string("memory_id")
    if not memory_id:
        raise InvalidArgument("id required")
    scope = owner_scope(params.string("user_id"), params.string("agent_id"))
    store = request.app[STORE]
    current = await store.GetMemory(
        store_pb2.GetMemoryRequest(scope=scope, id=memory_id), timeout=rpc_timeout(request)
    )
    if current.memory.status == "active":
        return json_response({"restored": False, "memory": list_items([current.memory])[0]})
    # The store also lifts the tombstones a forgotten row's forget left on its turns.
    ops = [store_pb2.Op(restore=store_pb2.RestoreOp(id=memory_id))]
    try:
        # The store decides in the same transaction whether there is anything to restore.
        reply = await store.Apply(
            store_pb2.ApplyRequest(
                scope=scope,
                ops=ops,
                actor="api",
                origin=params.string("origin"),
                reason=params.string("reason") or "restore",
            ),
            timeout=rpc_timeout(request),
        )
    except Conflict:
        current = await store.GetMemory(
            store_pb2.GetMemoryRequest(scope=scope, id=memory_id), timeout=rpc_timeout(request)
        )
        if current.memory.status != "active":  # still retired: the store said why
            raise
        # Restored by someone else meanwhile: the row as it is.
        return json_response({"restored": False, "memory": list_items([current.memory])[0]})
    return json_response({"restored": True, "memory": list_items(reply.memories)[0]})


def _new_version(
    old: common_pb2.Memory, text: str, event_at: tuple[float, int] | None, config: GatewayConfig
) -> store_pb2.NewMemory:
    """The row an edit inserts: the old row's owner, layer, label, sources, metadata, dates and
    writer's UTC offset with the new text (and event time with its offset, when given); a raw
    row is extracted again like a new write."""
    raw = old.layer == common_pb2.L2_RAW
    row = store_pb2.NewMemory(
        owner=old.owner,
        layer=old.layer,
        content=text,
        label=old.label,
        source_ids=old.source_ids,
        metadata_json=old.metadata_json,
        extraction_status=extraction_status(config) if raw else old.extraction_status,
        write_mode=config.mode,
        ref="edited",
        utc_offset_minutes=old.utc_offset_minutes,
    )
    for name in ("event_at", "valid_to", "due_at"):
        if old.HasField(name):
            setattr(row, name, getattr(old, name))
    if event_at is not None:
        row.event_at, row.utc_offset_minutes = event_at
    return row


def _edited_time(
    given: tuple[float, int | None] | None, old: common_pb2.Memory
) -> tuple[float, int] | None:
    """An edit's event time with its writer's UTC offset: a time that names no offset (unix
    seconds, as list and search give event_at back) keeps the row's."""
    if given is None:
        return None
    seconds, offset = given
    return seconds, old.utc_offset_minutes if offset is None else offset


def _event_time(row: common_pb2.Memory) -> tuple[float, int] | None:
    """A row's event time with its writer's UTC offset, None when it has none."""
    return (row.event_at, row.utc_offset_minutes) if row.HasField("event_at") else None


@routes.post("/api/v1/update")
@writes
async def update(request: web.Request) -> web.Response:
    """New text or event time for one of the owner's live rows: a new version is stored and
    the old one is retired as replaced by it (both keep their history); the row's own text
    and time change nothing."""
    params = await request_params(request)
    memory_id = params.string("id") or params.string("memory_id")
    text = params.string("text", strip=False)
    given_at = params.time_and_offset("event_at")
    if not memory_id or (not text.strip() and (text or given_at is None)):
        raise InvalidArgument("id and text (or event_at) required")
    scope = owner_scope(params.string("user_id"), params.string("agent_id"))
    store = request.app[STORE]
    old = (
        await store.GetMemory(
            store_pb2.GetMemoryRequest(scope=scope, id=memory_id), timeout=rpc_timeout(request)
        )
    ).memory
    if old.status != "active":
        raise Conflict(f"memory {memory_id!r} is retired: restore it before editing")
    text = text or old.content
    event_at = _edited_time(given_at, old)
    if text == old.content and event_at in (None, _event_time(old)):
        # A new version would say the same: the row stays as it is.
        return json_response({"success": True, "memory_id": memory_id, "replaced": "",
                              "changed": False, "extraction_status": old.extraction_status})
    retire = store_pb2.RetireOp(id=memory_id, superseded_how="replaced", superseded_by="$edited")
    reply = await store.Apply(
        store_pb2.ApplyRequest(
            scope=scope,
            ops=[
                store_pb2.Op(insert=_new_version(old, text, event_at, request.app[CONFIG])),
                store_pb2.Op(retire=retire),
            ],
            actor="api",
            origin=params.string("origin"),
            reason=params.string("reason") or "edited",
        ),
        timeout=rpc_timeout(request),
    )
    new = reply.memories[0]
    status_ = new.extraction_status
    if new.layer == common_pb2.L2_RAW and status_ == "pending":
        status_ = await _extract(request, scope, new.id)
    return json_response({"success": True, "memory_id": new.id, "replaced": memory_id,
                          "changed": True, "extraction_status": status_})


@routes.get("/api/v1/history")
@routes.post("/api/v1/history")
async def history(request: web.Request) -> web.Response:
    """The audit trail of one of the owner's rows, oldest first."""
    params = await request_params(request)
    memory_id = params.string("id") or params.string("memory_id")
    if not memory_id:
        raise InvalidArgument("id required")
    scope = owner_scope(params.string("user_id"), params.string("agent_id"))
    reply = await request.app[STORE].GetHistory(
        store_pb2.GetHistoryRequest(scope=scope, id=memory_id), timeout=rpc_timeout(request)
    )
    return json_response(
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


@routes.post("/api/v1/flush")
@writes
async def flush(request: web.Request) -> web.Response:
    """Persists the store's vector indexes now (before a hard stop) and has its keyword indexes
    apply what is pending."""
    reply = await request.app[STORE].Flush(store_pb2.FlushRequest(), timeout=rpc_timeout(request))
    if not reply.HasField("vectors"):  # the whole store's count, not for a restricted token
        return json_response({"flushed": True})
    return json_response({"flushed": True, "vectors": reply.vectors})
