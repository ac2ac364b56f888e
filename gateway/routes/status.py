"""Status and metrics: what runs, how it is configured, and how much is stored."""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from gateway.errors import client_message
from gateway.readiness import all_serving, is_ready, service_states
from gateway.respond import all_users, json_response, rpc_timeout
from gateway.routes.digest import consolidation_status
from gateway.shapes import layer_counts
from gateway.state import CONFIG, COUNTERS, EXTRACTOR, STORE
from gateway.wording import extract_sync, mode_detail
from shared.errors import ServiceError, Unavailable
from shared.grants import SCOPES, current_grant, reaches_everyone
from shared.pb import extractor_pb2, store_pb2
from shared.redact import redact_url

log = logging.getLogger(__name__)

VERSION = "5.0.0-py"
# Status answers even when the extractor is slow to say how the LLM is.
LLM_STATUS_TIMEOUT_S = 10.0

routes = web.RouteTableDef()


async def _llm_status(request: web.Request) -> extractor_pb2.GetLlmStatusResponse | None:
    """What the extractor says about the LLM, or None when it cannot be asked."""
    config = request.app[CONFIG]
    if config.mode == "lite":
        return None
    try:
        return await request.app[EXTRACTOR].GetLlmStatus(
            extractor_pb2.GetLlmStatusRequest(),
            timeout=min(LLM_STATUS_TIMEOUT_S, rpc_timeout(request)),
        )
    except ServiceError as exc:
        log.warning("extractor status unavailable: %s", exc.message)
        return None


def reembed_status(job: store_pb2.Reembed) -> dict[str, Any]:
    """A re-embed in progress: searches use the model in `embed` until it is done. Its counts
    (and its error) are the whole store's: the store leaves them out for a token reaching only
    some owners."""
    shown: dict[str, Any] = {"to_model": job.to_model_id, "state": job.state}
    if job.HasField("total"):
        shown.update(done=job.done, total=job.total, error=job.error)
    return shown


def _scopes() -> list[str]:
    """The scopes the caller's token holds (every one when the API needs no token), so a client
    offers only what it may do."""
    grant = current_grant()
    return [scope for scope in SCOPES if grant is None or scope in grant.scopes]


def _problems(stats: store_pb2.GetStatsResponse) -> bool:
    """Whether the store refuses vector work (its model) or its keyword search misses writes."""
    return bool(stats.model_problem or stats.keyword_problem)


WRITE_PATH = ("embedder", "store")
"""The services every write goes through, whatever the mode."""


def _write_path_down(services: dict[str, str]) -> str:
    """What stops writes among the services on their path ("" when they all serve)."""
    down = [f"the {name} is {services[name]}" for name in WRITE_PATH
            if services.get(name, "serving") != "serving"]
    return f"degraded: {', '.join(down)}" if down else ""


async def _store_away(request: web.Request, exc: Unavailable) -> web.Response:
    """The 503 of a status whose counts the store cannot give: still which services serve and
    what stops writes, so a client can say what is down."""
    config = request.app[CONFIG]
    services = await service_states(request.app)
    body = {
        "error": client_message(request, exc),
        "status": "degraded",
        "ready": is_ready(services, config.mode),
        "services": services,
        "write_pipeline": _write_path_down(services) or "degraded: the store is unavailable",
        "version": VERSION,
        "mode": config.mode,
        "scopes": _scopes(),
        "reaches_every_owner": reaches_everyone(),
    }
    return json_response(body, status=exc.http_status)


@routes.get("/api/v1/status")
async def status(request: web.Request) -> web.Response:
    """Server, model, mode and per-layer counts; writes and searches count since this start."""
    config = request.app[CONFIG]
    asked = store_pb2.GetStatsRequest(scope=all_users())
    if config.catchup_max_age_s is not None:
        asked.unextracted_after = time.time() - config.catchup_max_age_s
    try:
        stats = await request.app[STORE].GetStats(asked, timeout=rpc_timeout(request))
    except Unavailable as exc:
        return await _store_away(request, exc)
    counters = request.app[COUNTERS]
    services = await service_states(request.app)
    llm = await _llm_status(request)
    if llm is not None:
        state, pipeline = llm.llm, llm.write_pipeline
    elif config.mode == "lite":
        state, pipeline = "unused", "ok"
    else:  # the extractor owns the LLM's state; the gateway does not guess it
        state, pipeline = "unknown", "degraded: the extractor is unavailable"
    pipeline = _write_path_down(services) or pipeline
    extras: dict[str, Any] = {}
    whole_server = reaches_everyone()
    if stats.HasField("reembed"):
        extras["reembed"] = reembed_status(stats.reembed)
    if stats.model_problem:
        extras["embed_problem"] = stats.model_problem
    if stats.keyword_problem:
        extras["keyword_problem"] = stats.keyword_problem
    # The whole server's counts: not for a token reaching some owners.
    if whole_server:
        extras.update(writes=counters.writes, searches=counters.searches,
                      data_dir=stats.data_dir or str(config.data_dir))
        if llm is not None:
            extras.update(
                dropped_ops=llm.dropped_ops,
                refused_forgotten=llm.refused_forgotten,
                extracting=llm.in_flight,
            )
    return json_response(
        {
            "status": "degraded" if _problems(stats) or not all_serving(services) else "ok",
            "ready": is_ready(services, config.mode),
            "services": services,
            "version": VERSION,
            "vdb": "ok",
            "embed": stats.model_id,
            "embed_dims": stats.ndim,
            "llm": state,
            "llm_model": config.llm_model,
            "llm_base": redact_url(config.llm_base),
            "mode": config.mode,
            "mode_detail": mode_detail(config),
            "uses_llm": config.mode != "lite",
            "extract_sync": extract_sync(config),
            "write_pipeline": pipeline,
            "layers": layer_counts(stats.layers),
            "graph_nodes": stats.graph_nodes,
            "graph_edges": stats.graph_edges,
            "unextracted": 0 if config.mode == "lite" else stats.unextracted,
            **await consolidation_status(request),
            "vdb_points": stats.total,
            "scopes": _scopes(),
            "reaches_every_owner": whole_server,
            **extras,
        }
    )


@routes.get("/api/v1/metrics")
async def metrics(request: web.Request) -> web.Response:
    """Live rows per layer and in total, and the graph's size."""
    stats = await request.app[STORE].GetStats(
        store_pb2.GetStatsRequest(scope=all_users()), timeout=rpc_timeout(request)
    )
    return json_response(
        {
            "layers": layer_counts(stats.layers),
            "total": stats.total,
            "graph_nodes": stats.graph_nodes,
            "graph_edges": stats.graph_edges,
        }
    )
