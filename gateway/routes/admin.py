"""The admin maintenance jobs (HYATLAS_ADMIN=on, POST only): compact raw turns, dedupe facts,
snapshots."""

from __future__ import annotations

from aiohttp import web

from gateway.params import Params
from gateway.respond import json_response, request_params
from gateway.routes.digest import PASS_TIMEOUT_S
from gateway.state import CONFIG, STORE
from shared.errors import PermissionDenied
from shared.pb import store_pb2

DEDUPE_DEFAULT = 0.92
"""Cosine similarity at or above which dedupe_facts takes two live facts for one (threshold 0)."""
ADMIN_OFF = "maintenance endpoints are off: restart the server with HYATLAS_ADMIN=on"

routes = web.RouteTableDef()


async def _admin_params(request: web.Request) -> Params:
    if not request.app[CONFIG].admin:
        raise PermissionDenied(ADMIN_OFF)
    return await request_params(request)


@routes.post("/api/v1/admin/compact_raw")
async def compact_raw(request: web.Request) -> web.Response:
    """Caps raw turns (USER/ASSISTANT only, 4000 bytes a message, 12000 a turn); dry run first."""
    params = await _admin_params(request)
    reply = await request.app[STORE].CompactRaw(
        store_pb2.CompactRawRequest(dry_run=params.boolean("dry_run", True)),
        timeout=PASS_TIMEOUT_S,
    )
    return json_response(
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


@routes.post("/api/v1/admin/dedupe_facts")
async def dedupe_facts(request: web.Request) -> web.Response:
    """Supersedes near-duplicate live facts of each person by the newer one; dry run first."""
    params = await _admin_params(request)
    threshold = params.number("threshold", lo=0.0, hi=1.0) or DEDUPE_DEFAULT
    dry_run = params.boolean("dry_run", True)
    reply = await request.app[STORE].RestateFacts(
        store_pb2.RestateFactsRequest(threshold=threshold, dry_run=dry_run),
        timeout=PASS_TIMEOUT_S,
    )
    return json_response(
        {
            "dry_run": dry_run,
            "threshold": threshold,
            "owners": reply.owners,
            "facts": reply.facts,
            "duplicates": reply.duplicates,
            "sample": list(reply.sample),
            "rows_superseded": reply.rows_superseded,
        }
    )


@routes.post("/api/v1/admin/snapshot")
async def snapshot(request: web.Request) -> web.Response:
    """Writes a snapshot of the data directory now, as the schedule would."""
    await _admin_params(request)
    reply = await request.app[STORE].TakeSnapshot(
        store_pb2.TakeSnapshotRequest(), timeout=PASS_TIMEOUT_S
    )
    return json_response(
        {"path": reply.path, "bytes": reply.size_bytes, "paused_s": round(reply.paused_s, 3)}
    )
