"""Extraction's routes: reprocess raw rows, hand over an LLM key; and forgetting a value."""

from __future__ import annotations

import ipaddress
import re

from aiohttp import web

from gateway import admission
from gateway.respond import (
    INT32_MIN,
    all_users,
    json_response,
    owner_scope,
    request_params,
    rpc_timeout,
    writes,
)
from gateway.shapes import list_items
from gateway.state import CONFIG, EXTRACTOR, STORE
from shared.errors import InvalidArgument, PermissionDenied
from shared.limits import check_reprocess
from shared.pb import extractor_pb2, store_pb2
from shared.store_client import PAGE

routes = web.RouteTableDef()

# A header a proxy adds to say who its client is (Forwarded, Via, X-Forwarded-*, X-Real-IP,
# True-Client-IP, CF-Connecting-IP, X-Cluster-Client-IP, X-Remote-Addr, Client-IP, ...): its
# presence means the peer address is a proxy's, not the client's.
_FORWARDING_HEADER = re.compile(r"^via$|forwarded|(^|-)(ip|addr|client)(-|$)", re.IGNORECASE)


@routes.post("/api/v1/reprocess")
async def reprocess(request: web.Request) -> web.Response:
    """Re-extracts the given raw rows, or (ids absent) up to max unextracted ones, oldest
    first."""
    config = request.app[CONFIG]
    params = await request_params(request)
    ids = params.ids("ids", PAGE) or []
    most = params.integer("max", 0, lo=INT32_MIN)
    most = 200 if most <= 0 else most  # the reference's: none or less is its default
    check_reprocess(ids, most, PAGE)  # lite answers without the extractor, which checks too
    if config.mode == "lite":
        if ids:
            skipped = len(ids)
        else:
            stats = await request.app[STORE].GetStats(
                store_pb2.GetStatsRequest(scope=all_users()), timeout=rpc_timeout(request)
            )
            skipped = min(most, int(stats.layers.get("l2_raw", 0)))
        return json_response(
            {
                "reprocessed": 0,
                "failed": 0,
                "skipped": skipped,
                "note": "mode is lite; extraction is disabled, nothing to reprocess",
            }
        )
    admission.leave(request)  # what follows waits on the LLM
    reply = await request.app[EXTRACTOR].Reprocess(
        extractor_pb2.ReprocessRequest(ids=ids, max=most),
        timeout=max(rpc_timeout(request), (2 * config.extract_timeout_s + 30.0) * 4),
    )
    return json_response(
        {"reprocessed": reply.reprocessed, "failed": reply.failed, "skipped": reply.skipped}
    )


def _loopback(request: web.Request) -> bool:
    """Whether the client connected from this machine, not through a proxy."""
    if any(_FORWARDING_HEADER.search(name) for name in request.headers):
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
    params = await request_params(request)
    key = params.string("key") or params.string("llm_key")
    if not key:
        raise InvalidArgument("key required")
    reply = await request.app[EXTRACTOR].SetLlmKey(
        extractor_pb2.SetLlmKeyRequest(key=key), timeout=rpc_timeout(request)
    )
    return json_response({"ok": True, "llm": reply.llm})


@routes.post("/api/v1/forget")
@writes
async def forget(request: web.Request) -> web.Response:
    """Retires the owner's rows holding a value (by text or id) and tombstones the value."""
    params = await request_params(request)
    text = params.string("text") or params.string("old_text")
    memory_id = params.string("id") or params.string("memory_id")
    if bool(text) == bool(memory_id):
        raise InvalidArgument("pass exactly one of text and id")
    metadata = params.obj("metadata")
    origin = metadata.get("write_origin") or params.string("source") or params.string("origin")
    origin = origin if isinstance(origin, str) else ""
    reply = await request.app[STORE].Forget(
        store_pb2.ForgetRequest(
            scope=owner_scope(params.string("user_id"), params.string("agent_id")),
            text=text,
            id=memory_id,
            reason=params.string("reason"),
            origin=origin,
            memory_tool=origin == "memory_tool",
            target=params.string("target"),
        ),
        timeout=rpc_timeout(request),
    )
    return json_response(
        {
            "forgotten": len(reply.memories),
            "memories": list_items(reply.memories),
            "evidence_ids": list(reply.evidence_ids),
        }
    )
