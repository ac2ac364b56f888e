"""The consolidation pass routes: its status fields, the digest (run a pass now) and undo."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.errors import error_extras
from gateway.respond import all_users, json_response, request_params, rpc_timeout, writes
from gateway.state import CONFIG, CONSOLIDATOR, STORE
from shared.dates import rfc3339
from shared.errors import Conflict, InvalidArgument, ServiceError
from shared.grants import reaches_everyone
from shared.pb import consolidator_pb2, store_pb2

NO_SLOW_PATH = "this mode has no slow path; consolidation runs only in ultra"
NO_UNDO = (
    "a pass is reverted by the consolidator, which runs only in ultra mode; restart in ultra, "
    "or restore single rows with /api/v1/restore"
)
PASS_TIMEOUT_S = 11 * 60.0
ZERO_TIME = "0001-01-01T00:00:00Z"
# Report fields the reference leaves out when empty.
_OMIT_EMPTY = ("skipped_owners", "errors")

routes = web.RouteTableDef()


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
        store_pb2.GetStatsRequest(scope=all_users()),
        timeout=rpc_timeout(request),
    )
    return stats.graph_nodes, stats.graph_edges


async def consolidation_status(request: web.Request) -> dict[str, Any]:
    """The status fields of the slow path: consolidations, last_consolidated_at (when the last
    pass ended) and last_consolidated (its report)."""
    if request.app[CONFIG].mode != "ultra":
        return {"consolidations": -1}
    try:
        reply = await request.app[CONSOLIDATOR].GetDigest(
            consolidator_pb2.GetDigestRequest(), timeout=5.0
        )
    except ServiceError:  # status answers while the consolidator is down or failing
        return {"consolidations": 0}
    fields: dict[str, Any] = {"consolidations": reply.runs}
    if reply.last_at:
        fields["last_consolidated_at"] = rfc3339(reply.last_at)
    # A pass report names every owner it skipped or failed on: not for a token reaching some.
    if reply.HasField("last") and reaches_everyone():
        fields["last_consolidated"] = report_json(reply.last)
    return fields


@routes.get("/api/v1/digest")
@routes.post("/api/v1/digest")
@error_extras(digest_ok=False)
async def digest(request: web.Request) -> web.Response:
    """GET: passes so far and the last report; POST: runs one pass now and returns its report."""
    config = request.app[CONFIG]
    if config.mode != "ultra":
        return json_response({"digest_ok": False, "mode": config.mode, "reason": NO_SLOW_PATH})
    consolidator = request.app[CONSOLIDATOR]
    if request.method == "POST":
        await request_params(request)  # takes none, but a malformed body is a 400 as anywhere
        reply = await consolidator.RunPass(
            consolidator_pb2.RunPassRequest(), timeout=PASS_TIMEOUT_S
        )
        if not reply.ran:
            return json_response({"digest_ok": False, "reason": reply.reason})
        nodes, edges = await _graph_counts(request)
        return json_response(
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
    return json_response(
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
@writes
async def undo_pass(request: web.Request) -> web.Response:
    """Reverts every change of one consolidation pass: {pass_id}."""
    params = await request_params(request)
    pass_id = params.string("pass_id")
    if not pass_id:
        raise InvalidArgument("pass_id is required")
    if request.app[CONFIG].mode != "ultra":
        raise Conflict(NO_UNDO)
    reply = await request.app[CONSOLIDATOR].RevertPass(
        consolidator_pb2.RevertPassRequest(pass_id=pass_id, actor="api"),
        timeout=rpc_timeout(request),
    )
    return json_response(
        {
            "undone": True,
            "pass_id": reply.pass_id,
            "restored": list(reply.restored_ids),
            "retired": list(reply.undone_ids),
            "edges": list(reply.edge_ids),
            "kept": list(reply.kept_ids),
            "kept_why": dict(reply.kept_why),
        }
    )
