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
from urllib.parse import urlsplit, urlunsplit

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.shapes import list_item, rfc3339
from gateway.state import CONFIG, STORE
from shared.errors import InvalidArgument, NotFound
from shared.pb import common_pb2, store_pb2
from shared.rpc import open_channel
from shared.settings import SERVICES, Settings

STATIC_DIR = Path(__file__).resolve().parent / "dashboard"
DEFAULT_USER = "default"
# Settings whose value is a credential: the dashboard says only whether each is set.
SECRET_SETTINGS = frozenset(
    {"token", "embed_key", "llm_key", "llm_key_file", "llm_fallback_key"}
)
# Settings holding a URL, which may carry user:password before the host.
URL_SETTINGS = frozenset({"llm_base", "llm_fallback_base", "embed_base"})
# How many of an owner's rows a detail view scans for the rows a memory replaced.
REPLACED_SCAN_MAX = 5000
REPLACED_SCAN_PAGE = 500
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


def _json(body: Any) -> web.Response:
    return web.json_response(body, dumps=lambda v: json.dumps(v, ensure_ascii=False))


def _timeout(request: web.Request) -> float:
    return request.app[CONFIG].rpc_timeout_s


def _scope(request: web.Request) -> common_pb2.Scope:
    """The owner the page selected (user_id defaults like the API's)."""
    query = request.query
    return common_pb2.Scope(
        user_id=query.get("user_id", "").strip() or DEFAULT_USER,
        agent_id=query.get("agent_id", "").strip(),
    )


def _without_userinfo(url: str) -> str:
    """A URL with any user:password@ removed."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(unparsable URL)"
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def _plain(value: Any) -> Any:
    """A setting value as JSON: paths and sets as text, durations in seconds."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, frozenset | set):
        return sorted(value)
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def public_settings(settings: Settings) -> dict[str, Any]:
    """Every setting in force, credentials replaced by whether they are set."""
    shown: dict[str, Any] = {}
    for spec in fields(settings):
        value = getattr(settings, spec.name)
        if spec.name in SECRET_SETTINGS:
            shown[spec.name] = "(set)" if value else "(not set)"
        elif spec.name in URL_SETTINGS and isinstance(value, str):
            shown[spec.name] = _without_userinfo(value)
        else:
            shown[spec.name] = _plain(value)
    return shown


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
            store_pb2.GetMemoryRequest(scope=scope, id=memory_id), timeout=_timeout(request)
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
            return None
        raise
    return reply.memory


async def _replaced(
    request: web.Request, scope: common_pb2.Scope, memory: common_pb2.Memory
) -> tuple[list[common_pb2.Memory], int, bool]:
    """Rows this one superseded, the rows scanned, and whether the scan saw every candidate."""
    found: list[common_pb2.Memory] = []
    scanned = 0
    while scanned < REPLACED_SCAN_MAX:
        reply = await request.app[STORE].ListMemories(
            store_pb2.ListMemoriesRequest(
                scope=scope,
                include_superseded=True,
                limit=REPLACED_SCAN_PAGE,
                offset=scanned,
                # What a row replaced was stored before the row itself changed last.
                created_before=max(memory.created_at, memory.updated_at) + 1.0,
            ),
            timeout=_timeout(request),
        )
        found.extend(
            m for m in reply.memories if m.status != "active" and m.superseded_by == memory.id
        )
        scanned += len(reply.memories)
        if scanned >= reply.total or not reply.memories:
            return found, scanned, True
    return found, scanned, False


async def memory_detail(request: web.Request) -> web.Response:
    """One row of the owner with its source rows, what it replaced and what replaced it."""
    memory_id = request.query.get("id", "").strip()
    if not memory_id:
        raise InvalidArgument("id required")
    scope = _scope(request)
    memory = await _get(request, scope, memory_id)
    if memory is None:
        raise NotFound(f"memory {memory_id!r} not found")
    sources = await asyncio.gather(*(_get(request, scope, sid) for sid in memory.source_ids))
    successor = (
        await _get(request, scope, memory.superseded_by) if memory.superseded_by else None
    )
    replaced, scanned, complete = await _replaced(request, scope, memory)
    return _json(
        {
            "memory": _full_item(memory),
            "sources": [_full_item(m) for m in sources if m is not None],
            "missing_sources": [
                sid for sid, m in zip(memory.source_ids, sources, strict=True) if m is None
            ],
            "replaced_by": _full_item(successor) if successor is not None else None,
            "replaced": [_full_item(m) for m in replaced],
            "replaced_scan": {"rows": scanned, "complete": complete},
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

    async def count(start: datetime, layers: list[Any], exclude: list[Any]) -> int:
        begin = start.timestamp()
        reply = await store.ListMemories(
            store_pb2.ListMemoriesRequest(
                scope=scope,
                layers=layers,
                exclude_layers=exclude,
                include_superseded=True,
                limit=0,
                created_after=begin - 1e-6,  # created_after is exclusive
                created_before=begin + 86400.0,
            ),
            timeout=_timeout(request),
        )
        return int(reply.total)

    raw = common_pb2.L2_RAW
    counts = await asyncio.gather(
        *(count(start, [raw], []) for start in starts),
        *(count(start, [], [raw]) for start in starts),
    )
    return _json(
        {
            "user_id": scope.user_id,
            "agent_id": scope.agent_id,
            "days": [
                {"date": start.strftime("%Y-%m-%d"), "raw": counts[i], "derived": counts[days + i]}
                for i, start in enumerate(starts)
            ],
        }
    )


async def _health(name: str, address: str) -> dict[str, str]:
    """What a service's gRPC health check answers, or why it could not be asked."""
    try:
        async with open_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S
            )
    except grpc.aio.AioRpcError as exc:
        state = "unreachable" if exc.code() in (
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED
        ) else exc.code().name.lower()
        return {"name": name, "address": address, "status": state}
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status).lower()
    return {"name": name, "address": address, "status": status}


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
        if path.is_file():
            stat = path.stat()
            found.append(
                {"name": path.name, "bytes": stat.st_size, "modified": rfc3339(stat.st_mtime)}
            )
    return sorted(found, key=lambda item: item["modified"], reverse=True)


async def system(request: web.Request) -> web.Response:
    """Service health, settings in force (no secrets), data directory size and snapshots."""
    settings = request.app[SETTINGS]
    addresses = dict(settings.addresses)
    health = await asyncio.gather(*(_health(name, addresses[name]) for name in SERVICES))
    data_bytes, snapshots = await asyncio.gather(
        asyncio.to_thread(_tree_bytes, settings.data_dir),
        asyncio.to_thread(_snapshots, settings.snapshot_dir),
    )
    return _json(
        {
            "services": [{"name": "gateway", "address": "(this process)", "status": "serving"}]
            + list(health),
            "settings": public_settings(settings),
            "data_dir": str(settings.data_dir),
            "data_bytes": data_bytes,
            "snapshots": {
                "dir": str(settings.snapshot_dir),
                "every_s": settings.snapshot_every_s,
                "keep": settings.snapshot_keep,
                "files": snapshots,
            },
            "now": rfc3339(time.time()),
        }
    )


def _static_file(tail: str) -> Path:
    """The file under the dashboard folder a URL tail names; anything outside it is a 404."""
    path = (STATIC_DIR / (tail or "index.html")).resolve()
    if not path.is_relative_to(STATIC_DIR) or not path.is_file():
        raise NotFound(f"/dashboard/{tail} not found")
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


def register(app: web.Application, settings: Settings | None = None) -> None:
    """Adds the dashboard's routes; call before the API's placeholder routes."""
    app[SETTINGS] = settings if settings is not None else Settings.from_env()
    app.router.add_get("/dashboard/api/memory", memory_detail)
    app.router.add_get("/dashboard/api/writes", writes)
    app.router.add_get("/dashboard/api/system", system)
    app.router.add_get("/dashboard", to_index)
    app.router.add_get("/dashboard/", static)
    app.router.add_get("/dashboard/{tail:(?!api/).+}", static)
