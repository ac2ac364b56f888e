"""Hermes dashboard backend for the HyAtlas tab: a FastAPI router proxying to the gateway."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from fastapi import APIRouter, HTTPException, Query

PLUGIN_DIR = Path(__file__).resolve().parent.parent
SUPPORT_PACKAGE = "_hyatlas_dashboard_support"


def _plugin_module(name: str) -> ModuleType:
    """A sibling module of the plugin (Hermes imports this file alone, not as a package)."""
    if SUPPORT_PACKAGE not in sys.modules:
        spec = importlib.machinery.ModuleSpec(SUPPORT_PACKAGE, None, is_package=True)
        spec.submodule_search_locations = [str(PLUGIN_DIR)]
        sys.modules[SUPPORT_PACKAGE] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{SUPPORT_PACKAGE}.{name}")


_client_mod = _plugin_module("client")
_settings_mod = _plugin_module("settings")
_recall_mod = _plugin_module("recall")
LAYERS = _plugin_module("tools").LAYERS

router = APIRouter()


def _context(user_id: str, agent_id: str) -> tuple[Any, dict[str, str]]:
    client, owner, _ = _hermes_context(user_id, agent_id)
    return client, owner


def _hermes_context(user_id: str, agent_id: str) -> tuple[Any, dict[str, str], str]:
    """The gateway's client, the owner the tab shows, and the agent id this Hermes writes as."""
    try:
        settings = _settings_mod.load_settings(_settings_mod.hermes_home_dir())
    except ValueError as exc:
        raise HTTPException(status_code=500, detail=f"hyatlas config: {exc}") from None
    default_user, writer = _settings_mod.resolve_ids(settings, _settings_mod.hermes_identity())
    client = _client_mod.HyAtlasClient(settings.server_url, timeout_s=settings.timeout_s,
                                       token=settings.token)
    # The tab is the person's view: every agent of the user unless one is asked for.
    return client, {"user_id": user_id or default_user, "agent_id": agent_id}, writer


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except _client_mod.HttpError as exc:
        raise HTTPException(status_code=exc.status, detail=exc.message) from None
    except _client_mod.ClientError as exc:
        raise HTTPException(status_code=502, detail=str(exc)) from None


def _check_layer(layer: str) -> str:
    if layer and layer not in LAYERS:
        raise HTTPException(status_code=400, detail=f"layer {layer!r} is not one of {LAYERS}")
    return layer


@router.get("/status")
def status() -> Any:
    """The gateway's /api/v1/status (its counts are the whole server's), plus the owner the tab
    shows, the agent id this Hermes writes as, and that owner's live rows: in all and per
    layer."""
    client, owner, writer = _hermes_context("", "")
    body = _call(client.status)
    listed = _call(client.recent, limit=1, **owner)
    body["hermes_owner"] = owner
    body["hermes_agent"] = writer
    body["owner_memories"] = {"total": listed.get("total"), "layers": listed.get("layers", {})}
    return body


@router.get("/search")
def search(
    q: str = Query(..., min_length=1),
    layer: str = "",
    limit: int = Query(10, ge=1, le=50),
    user_id: str = "",
    agent_id: str = "",
) -> Any:
    """Searches memories; the answer keeps the gateway's channels, plus the text Hermes recalls."""
    client, owner = _context(user_id, agent_id)
    answer = _call(client.search, q, limit=limit, layer=_check_layer(layer), **owner)
    answer["recall_text"] = _recall_mod.format_recall(answer, q, per_channel=limit)
    return answer


@router.get("/recent")
def recent(
    layer: str = "",
    limit: int = Query(20, ge=1, le=200),
    before: str = "",
    include_raw: bool = True,
    user_id: str = "",
    agent_id: str = "",
) -> Any:
    """The newest memories, after the row `before` names (a page's next_before), with the total
    (the gateway's /api/v1/list) and `more`: whether older rows are left."""
    client, owner = _context(user_id, agent_id)
    query = {"layer": _check_layer(layer), "include_raw": include_raw, **owner}
    body = _call(client.recent, limit=limit, before=before, **query)
    cursor = body.get("next_before", "")
    # Asked, not counted: rows written or retired between pages make the total no guide.
    full = cursor and len(body.get("memories", [])) == limit
    body["more"] = bool(full and _call(client.recent, limit=1, before=cursor, **query)["memories"])
    return body
