"""The dashboard: its static files at /dashboard/ and the read-only JSON it needs beyond /api/v1."""

from __future__ import annotations

import asyncio
import json
import mimetypes
import os
import time
from collections.abc import Mapping
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.params import Params
from gateway.readiness import service_states
from gateway.respond import all_users, json_response, owner_scope, rpc_timeout
from gateway.shapes import list_item
from gateway.state import STORE
from services.search.switches import switchable_names
from shared.aliases import Aliases
from shared.calibration import calibrated_floor
from shared.dates import rfc3339
from shared.errors import InvalidArgument, NotFound, ServiceError
from shared.grants import check_everyone
from shared.limits import MAX_NAME_CHARS
from shared.pb import common_pb2, store_pb2
from shared.redact import shown_setting
from shared.settings import SERVICES, Settings
from shared.snapshot_names import is_snapshot_name
from shared.store_client import all_rows, get_many

STATIC_DIR = Path(__file__).resolve().parent / "dashboard"
# How many of an owner's rows a detail view scans for the rows a memory replaced.
WRITES_DAYS_DEFAULT = 14
WRITES_DAYS_MAX = 90
HEALTH_TIMEOUT_S = 1.0
# Locks the page to its own origin: no script, style, font or request from anywhere else.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
STATIC_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
SETTINGS = web.AppKey("dashboard_settings", Settings)


def _scope(request: web.Request) -> common_pb2.Scope:
    """The owner the page selected (user_id defaults like the API's)."""
    params = Params(request.query, {})
    return owner_scope(params.string("user_id"), params.string("agent_id"))


def _plain(value: Any) -> Any:
    """A setting value as JSON: paths and sets as text, durations in seconds."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Aliases):
        return _plain(value.groups)
    if isinstance(value, frozenset | set):
        return sorted(value)
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _flat_settings(settings: Settings) -> dict[str, Any]:
    """Every setting by name; the LLM's as llm_<name> (llm_base, llm_key, ...)."""
    flat = {spec.name: getattr(settings, spec.name) for spec in fields(settings)}
    llm = flat.pop("llm")
    flat.update({f"llm_{spec.name}": getattr(llm, spec.name) for spec in fields(llm)})
    return flat


def public_settings(settings: Settings) -> dict[str, Any]:
    """Every setting in force, credentials replaced by whether they are set."""
    return {
        name: shown_setting(name, _plain(value))
        for name, value in _flat_settings(settings).items()
    }


def _full_item(memory: common_pb2.Memory) -> dict[str, Any]:
    """A row with everything the detail view shows: both time axes, sources, metadata."""
    item = list_item(memory)
    try:
        metadata = json.loads(memory.metadata_json) if memory.metadata_json else {}
    except ValueError:
        metadata = {"unparsable": memory.metadata_json}
    item.update(
        {
            "status": memory.status,
            "created_at": rfc3339(memory.created_at),
            "updated_at": rfc3339(memory.updated_at) if memory.updated_at else "",
            "event_at": rfc3339(memory.event_at) if memory.HasField("event_at") else "",
            "valid_to": rfc3339(memory.valid_to) if memory.HasField("valid_to") else "",
            "due_at": rfc3339(memory.due_at) if memory.HasField("due_at") else "",
            "source_ids": list(memory.source_ids),
            "metadata": metadata,
            "model_id": memory.model_id,
            "hits": memory.hits,
            "retired_by": memory.retired_by,
            "write_mode": memory.write_mode,
        }
    )
    return item


async def _get(
    request: web.Request, scope: common_pb2.Scope, memory_id: str
) -> common_pb2.Memory | None:
    """One of the owner's rows, or None when it is missing or another owner's."""
    try:
        reply = await request.app[STORE].GetMemory(
            store_pb2.GetMemoryRequest(scope=scope, id=memory_id), timeout=rpc_timeout(request)
        )
    except NotFound:
        return None
    return reply.memory


async def memory_detail(request: web.Request) -> web.Response:
    """One row of the owner with its source rows, what it replaced and what replaced it."""
    memory_id = Params(request.query, {}).string("id")
    if not memory_id:
        raise InvalidArgument("id required")
    scope = _scope(request)
    memory = await _get(request, scope, memory_id)
    if memory is None:
        raise NotFound(f"memory {memory_id!r} not found")
    store, timeout = request.app[STORE], rpc_timeout(request)
    sources, successor, replaced = await asyncio.gather(
        get_many(store, scope, memory.source_ids, timeout),
        get_many(store, scope, [memory.superseded_by] if memory.superseded_by else [], timeout),
        all_rows(store, store_pb2.ListMemoriesRequest(
            scope=scope, include_superseded=True, superseded_by=memory.id), timeout),
    )
    found = {m.id for m in sources}
    return json_response(
        {
            "memory": _full_item(memory),
            "sources": [_full_item(m) for m in sources],
            "missing_sources": [sid for sid in memory.source_ids if sid not in found],
            "replaced_by": _full_item(successor[0]) if successor else None,
            "replaced": [_full_item(m) for m in replaced],
        }
    )


def _days(request: web.Request) -> int:
    raw = request.query.get("days", "").strip()
    if not raw:
        return WRITES_DAYS_DEFAULT
    try:
        days = int(raw)
    except ValueError:
        raise InvalidArgument("days must be an integer") from None
    if not 1 <= days <= WRITES_DAYS_MAX:
        raise InvalidArgument(f"days must be between 1 and {WRITES_DAYS_MAX}")
    return days


async def writes(request: web.Request) -> web.Response:
    """Rows the owner gained per UTC day (raw writes and derived rows), oldest day first."""
    scope = _scope(request)
    days = _days(request)
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    starts = [today - timedelta(days=back) for back in range(days - 1, -1, -1)]
    store = request.app[STORE]

    async def count(layers: list[Any], exclude: list[Any]) -> list[int]:
        reply = await store.CountMemories(
            store_pb2.CountMemoriesRequest(
                scope=scope,
                layers=layers,
                exclude_layers=exclude,
                include_superseded=True,
                start=starts[0].timestamp(),
                bucket_s=86400.0,
                buckets=days,
            ),
            timeout=rpc_timeout(request),
        )
        return list(reply.counts)

    raw = common_pb2.L2_RAW
    raw_counts, derived_counts = await asyncio.gather(count([raw], []), count([], [raw]))
    return json_response(
        {
            "user_id": scope.user_id,
            "agent_id": scope.agent_id,
            "days": [
                {"date": start.strftime("%Y-%m-%d"), "raw": raw_n, "derived": derived_n}
                for start, raw_n, derived_n in zip(starts, raw_counts, derived_counts, strict=True)
            ],
        }
    )


def _tree_bytes(root: Path) -> int:
    """Bytes in the regular files under root (sockets and links are not counted)."""
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            try:
                if path.is_file() and not path.is_symlink():
                    total += path.stat().st_size
            except OSError:
                continue  # a file removed while we walked
    return total


def _snapshots(folder: Path) -> list[dict[str, Any]]:
    """The snapshot files in folder, newest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        try:
            if not is_snapshot_name(path.name) or not path.is_file():
                continue
            stat = path.stat()
        except OSError:
            continue  # pruned while we listed
        found.append(
            {"name": path.name, "bytes": stat.st_size, "modified": rfc3339(stat.st_mtime)}
        )
    return sorted(found, key=lambda item: item["modified"], reverse=True)


async def _store_stats(request: web.Request) -> store_pb2.GetStatsResponse:
    """The store's model and backend (empty while the store does not answer)."""
    try:
        return await request.app[STORE].GetStats(
            store_pb2.GetStatsRequest(scope=all_users()), timeout=HEALTH_TIMEOUT_S
        )
    except ServiceError:
        return store_pb2.GetStatsResponse()


def settings_in_force(settings: Settings, model_id: str) -> dict[str, Any]:
    """The settings as the services apply them: the vector floor search really uses (the
    model's calibrated one unless HYATLAS_MIN_SCORE is set) and the model really embedding."""
    shown = public_settings(settings)
    del shown["min_score_set"]
    if not settings.min_score_set:
        shown["min_score"] = calibrated_floor(model_id) if model_id else "(the model's floor)"
    if not settings.embed_base.lower().startswith(("http://", "https://")):
        shown["embed_model"] = model_id or "(unknown while the store does not answer)"
    return shown


def _snapshot_failure(stats: store_pb2.GetStatsResponse) -> dict[str, str] | None:
    """The store's last scheduled snapshot, when it failed: when, why, and the next try."""
    if not stats.HasField("snapshot_failure"):
        return None
    failure = stats.snapshot_failure
    return {
        "at": rfc3339(failure.at),
        "reason": failure.reason,
        "retry_at": rfc3339(failure.retry_at),
    }


async def system(request: web.Request) -> web.Response:
    """Service health, settings in force (no secrets), data directory size (with the database's
    on PostgreSQL) and snapshots: the server's, so for a token reaching every owner."""
    check_everyone("the system view")
    settings = request.app[SETTINGS]
    states, stats = await asyncio.gather(service_states(request.app), _store_stats(request))
    health = [{"name": name, "address": settings.addresses[name], "status": states.get(name, "off")}
              for name in SERVICES]
    data_bytes, snapshots = await asyncio.gather(
        asyncio.to_thread(_tree_bytes, settings.data_dir),
        asyncio.to_thread(_snapshots, settings.snapshot_dir),
    )
    if stats.backend == "postgresql":  # the rows are in the database, not in the data dir
        data_bytes += stats.db_bytes
    return json_response(
        {
            "services": [{"name": "gateway", "address": "(this process)", "status": "serving"}]
            + health,
            "settings": settings_in_force(settings, stats.model_id),
            "store_backend": stats.backend,
            "data_dir": str(settings.data_dir),
            "data_bytes": data_bytes,
            "snapshots": {
                "dir": str(settings.snapshot_dir),
                "every_s": settings.snapshot_every_s,
                "keep": settings.snapshot_keep,
                "files": snapshots,
                "last_failure": _snapshot_failure(stats),
            },
            "now": rfc3339(time.time()),
        }
    )


async def search_stages(request: web.Request) -> web.Response:
    """The ranking stages a search's skip_stages may name, in the order they run."""
    return json_response({"stages": list(switchable_names())})


def _static_file(tail: str) -> Path:
    """The file under the dashboard folder a URL tail names; anything outside it is a 404."""
    try:
        path = (STATIC_DIR / (tail or "index.html")).resolve()
        found = path.is_relative_to(STATIC_DIR) and path.is_file()
    except (ValueError, OSError):  # a NUL byte, or a name the file system refuses (too long)
        found = False
    if not found:
        shown = tail[:MAX_NAME_CHARS].encode("utf-8", "replace").decode()
        raise NotFound(f"/dashboard/{shown} not found")
    return path


async def static(request: web.Request) -> web.StreamResponse:
    """A file of the dashboard: HTML, CSS and ES modules, all served from this folder."""
    path = _static_file(request.match_info.get("tail", ""))
    content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    if path.suffix == ".js":
        content_type = "text/javascript"
    body = await asyncio.to_thread(path.read_bytes)
    return web.Response(
        body=body, content_type=content_type, charset="utf-8", headers=STATIC_HEADERS
    )


# The shell holds no data (it asks for the token and sends it on every API call).
static.token_exempt = True  # type: ignore[attr-defined]


async def to_index(request: web.Request) -> web.StreamResponse:
    """/dashboard -> /dashboard/, so relative asset URLs resolve."""
    raise web.HTTPFound("/dashboard/")


to_index.token_exempt = True  # type: ignore[attr-defined]


def register(app: web.Application, settings: Settings) -> None:
    """Adds the dashboard's routes."""
    app[SETTINGS] = settings
    app.router.add_get("/dashboard/api/memory", memory_detail)
    app.router.add_get("/dashboard/api/writes", writes)
    app.router.add_get("/dashboard/api/system", system)
    app.router.add_get("/dashboard/api/search-stages", search_stages)
    app.router.add_get("/dashboard", to_index)
    app.router.add_get("/dashboard/", static)
    app.router.add_get("/dashboard/{tail:(?!api/).+}", static)
