"""The tools the model gets: schemas and handlers returning JSON strings."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .client import ClientError, HttpError, HyAtlasClient, NotHyAtlas, Unreachable, local_now
from .outbox import CONTAINS_CHARS, Outbox, new_idempotency_key, refused_for_good
from .settings import parse_flag

CANDIDATES = 3
"""How many close memories a forget by text that matched nothing offers instead."""
LAYERS = ("l1_profile", "l2_raw", "l3_fact", "l4_summary", "l5_knowledge", "l6_schema",
          "l7_intention", "l8_entity")
MAX_LIMIT = 50
CATCH_UP_S = 3.0
"""How long a tool's write waits for the ops queued before it to be sent, before it is queued
behind them instead."""


@dataclass
class Scope:
    """Who the tools act for; built by the provider, never from tool arguments."""

    client: HyAtlasClient
    user_id: str
    agent_id: str
    session_id: str
    outbox: Outbox | None
    can_write: bool


TOOL_SCHEMAS: list[dict[str, Any]] = [
    {
        "name": "hyatlas_status",
        "description": "HyAtlas memory server status: mode, counts per layer, LLM state.",
        "parameters": {"type": "object", "properties": {}},
    },
    {
        "name": "hyatlas_search",
        "description": "Search long-term memory (facts, profile, intentions, past turns). "
                       "Returns channels of memories with score, layer and date.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to look for."},
                "layer": {"type": "string", "enum": list(LAYERS),
                          "description": "Only this layer (optional)."},
                "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT,
                          "description": "Most results (default 10)."},
            },
            "required": ["query"],
        },
    },
    {
        "name": "hyatlas_recent",
        "description": "The most recent memories, newest first; with contains, only those "
                       "whose text holds it (any case), to find every memory that says a thing.",
        "parameters": {
            "type": "object",
            "properties": {
                "layer": {"type": "string", "enum": list(LAYERS)},
                "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT,
                          "description": "Most results (default 20)."},
                "include_raw": {"type": "boolean",
                                "description": "Include raw conversation turns (default true)."},
                "contains": {"type": "string", "maxLength": CONTAINS_CHARS,
                             "description": "Only memories whose text holds this, any case."},
            },
        },
    },
    {
        "name": "hyatlas_add",
        "description": "Store a note in long-term memory verbatim.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "description": "The note."}},
            "required": ["text"],
        },
    },
    {
        "name": "hyatlas_forget",
        "description": "Forget memories: by memory_id, or those whose whole text matches. "
                       "When nothing matches, the closest candidates come back: forget one "
                       "of them by its memory_id. Reversible with hyatlas_restore.",
        "parameters": {
            "type": "object",
            "properties": {
                "text": {"type": "string", "description": "Text of what to forget."},
                "memory_id": {"type": "string", "description": "One memory's id."},
                "reason": {"type": "string", "description": "Why (kept with the memory)."},
            },
        },
    },
    {
        "name": "hyatlas_restore",
        "description": "Bring back a memory that was forgotten (or otherwise retired), by the "
                       "memory_id a forget answered with.",
        "parameters": {
            "type": "object",
            "properties": {"memory_id": {"type": "string", "description": "The memory's id."}},
            "required": ["memory_id"],
        },
    },
]

TOOL_NAMES = frozenset(schema["name"] for schema in TOOL_SCHEMAS)


def _limit(args: dict[str, Any], default: int) -> int:
    raw = args.get("limit", default)
    try:
        # int() would take true for 1 and cut 2.5 to 2: neither is a count the model meant.
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"limit must be an integer, got {raw!r}") from None
    if not 1 <= value <= MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, got {value}")
    return value


def _layer(args: dict[str, Any]) -> str:
    layer = str(args.get("layer") or "")
    if layer and layer not in LAYERS:
        raise ValueError(f"layer {layer!r} is not one of {', '.join(LAYERS)}")
    return layer


def _optional_text(args: dict[str, Any], key: str) -> str:
    """The argument's text, stripped; "" when it is absent or null."""
    value = args.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {type(value).__name__}")
    return value.strip()


def _text(args: dict[str, Any], key: str) -> str:
    value = _optional_text(args, key)
    if not value:
        raise ValueError(f"{key} is required")
    return value


def queue_counts(outbox: Outbox) -> dict[str, Any]:
    """The local queue as status answers show it: writes waiting, writes the server refused,
    and writes that left unsent, by reason."""
    return {"plugin_queue": outbox.pending(), "plugin_refused": outbox.refused(),
            "plugin_dropped": outbox.dropped()}


def _status(scope: Scope, args: dict[str, Any]) -> Any:
    """The server's status with the local queue's counts; the counts also when the server
    does not answer, since that is when writes wait in the queue."""
    counts = {} if scope.outbox is None else queue_counts(scope.outbox)
    try:
        status = scope.client.status()
    except ClientError as exc:
        if not counts:
            raise
        return {"error": str(exc), **counts}
    return {**status, **counts}


def _search(scope: Scope, args: dict[str, Any]) -> Any:
    return scope.client.search(
        _text(args, "query"), user_id=scope.user_id, agent_id=scope.agent_id,
        limit=_limit(args, 10), layer=_layer(args), session_id=scope.session_id,
    )


def _recent(scope: Scope, args: dict[str, Any]) -> Any:
    raw = args.get("include_raw")
    return scope.client.recent(
        user_id=scope.user_id, agent_id=scope.agent_id, limit=_limit(args, 20),
        layer=_layer(args), include_raw=True if raw is None else parse_flag("include_raw", raw),
        contains=_optional_text(args, "contains"),
    )


def send_or_queue(outbox: Outbox | None, kind: str, payload: dict[str, Any],
                  send: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """Sends an op now with send(idempotency_key), or keeps it in the outbox: behind the ops
    queued before it, so it never overtakes them (a forget sent before its note's queued add
    would leave the note live), or when the outbox would send it again: the server does not
    answer, is busy, refuses the token, or something else answers at its URL
    (outbox.refused_for_good says which refusals are final). The queued op keeps the key of
    the first try, so a try that did arrive is not stored twice."""
    key = new_idempotency_key()
    if outbox is not None and not outbox.caught_up(CATCH_UP_S):
        outbox.put(kind, payload, key)
        return _queued(f"{outbox.pending() - 1} earlier writes wait in the local queue "
                       f"({outbox.last_error or 'being sent'})")
    try:
        return send(key)
    except (Unreachable, NotHyAtlas, HttpError) as exc:
        if outbox is None or (isinstance(exc, HttpError) and refused_for_good(exc)):
            raise
        outbox.put(kind, payload, key)
        return _queued(str(exc))


def _queued(why: str) -> dict[str, Any]:
    return {"success": True, "queued": True,
            "note": f"not done yet ({why}); kept locally and sent in order once the server "
                    "takes it"}


def add_or_queue(client: HyAtlasClient, outbox: Outbox | None,
                 payload: dict[str, Any]) -> dict[str, Any]:
    """Stores a note now, or queues it (send_or_queue says when)."""
    return send_or_queue(outbox, "add", payload, lambda key: client.add(payload, key))


def forget_payload(owner: dict[str, str], *, text: str, memory_id: str,
                   reason: str) -> dict[str, Any]:
    """The body of a forget of one memory by id or of the memories holding a text (not both)."""
    if memory_id and text:
        raise ValueError("give a text or a memory id, not both")
    if not memory_id and not text:
        raise ValueError("a text or a memory id is required")
    what = {"memory_id": memory_id} if memory_id else {"text": text}
    return {**owner, **what, "reason": reason}


def forget_or_suggest(client: HyAtlasClient, payload: dict[str, Any]) -> dict[str, Any]:
    """Forgets by id or text; a text that matched nothing gets the closest memories back."""
    answer = client.forget(payload)
    text = payload.get("text")
    if answer.get("forgotten") or not text or payload.get("memory_id"):
        return answer
    found = client.search(text, user_id=payload["user_id"], agent_id=payload["agent_id"],
                          limit=CANDIDATES)
    hits = [item for channel in (found.get("memories") or {}).values()
            if isinstance(channel, list) for item in channel if isinstance(item, dict)]
    hits.sort(key=lambda item: -float(item.get("score") or 0.0))
    seen: set[str] = set()
    candidates = []
    for item in hits:
        if item.get("memory_id") and item["memory_id"] not in seen:
            seen.add(item["memory_id"])
            candidates.append({key: item.get(key) for key in ("memory_id", "content", "score")})
    answer["candidates"] = candidates[:CANDIDATES]
    answer["hint"] = ("nothing matched that text as a whole; to forget one of the candidates, "
                      "forget it by its memory_id" if candidates else "nothing matched that text")
    return answer


def _add(scope: Scope, args: dict[str, Any]) -> Any:
    if not scope.can_write:
        raise ValueError("this agent context does not write memories")
    return add_or_queue(scope.client, scope.outbox, {
        "text": _text(args, "text"),
        "user_id": scope.user_id,
        "agent_id": scope.agent_id,
        "session_id": scope.session_id,
        "event_at": local_now(),
        "metadata": {"write_origin": "tool", "tool_name": "hyatlas_add"},
    })


def _forget(scope: Scope, args: dict[str, Any]) -> Any:
    if not scope.can_write:
        raise ValueError("this agent context does not change memories")
    memory_id = _optional_text(args, "memory_id")
    payload = forget_payload(
        {"user_id": scope.user_id, "agent_id": scope.agent_id},
        text=_optional_text(args, "text"), memory_id=memory_id,
        reason=_optional_text(args, "reason") or "asked by the agent",
    )
    return send_or_queue(scope.outbox, "forget", payload,
                         lambda _key: _told_forgotten(forget_now(scope.client, payload)))


FORGOTTEN_NOTE = ("forgotten: recall no longer returns it; do not rely on earlier mentions of "
                  "it in this conversation")
"""What a forget tool call that forgot something tells the agent: the value is still in the
conversation's earlier messages, where recall cannot take it back."""


def _told_forgotten(answer: dict[str, Any]) -> dict[str, Any]:
    """A forget's answer to the agent, with FORGOTTEN_NOTE when it forgot something."""
    if answer.get("forgotten"):
        answer["note"] = FORGOTTEN_NOTE
    return answer


def forget_now(client: HyAtlasClient, payload: dict[str, Any]) -> dict[str, Any]:
    """forget_or_suggest; the gateway's own 404 is final: no such memory, or no forget."""
    try:
        return forget_or_suggest(client, payload)
    except HttpError as exc:
        if not (exc.from_gateway and exc.status in (404, 405, 501)):
            raise
        if payload.get("memory_id") and exc.status == 404:
            raise ClientError(str(exc)) from None
        raise ClientError("this server does not offer forget yet") from None


def _restore(scope: Scope, args: dict[str, Any]) -> Any:
    if not scope.can_write:
        raise ValueError("this agent context does not change memories")
    return scope.client.restore({"memory_id": _text(args, "memory_id"),
                                 "user_id": scope.user_id, "agent_id": scope.agent_id})


HANDLERS: dict[str, Callable[[Scope, dict[str, Any]], Any]] = {
    "hyatlas_status": _status,
    "hyatlas_search": _search,
    "hyatlas_recent": _recent,
    "hyatlas_add": _add,
    "hyatlas_forget": _forget,
    "hyatlas_restore": _restore,
}


def handle(scope: Scope, name: str, args: dict[str, Any] | None) -> str:
    """Runs one tool; always a JSON string, failures as {"error": ...}."""
    handler = HANDLERS.get(name)
    if handler is None:
        return json.dumps({"error": f"unknown tool {name!r}"})
    if not isinstance(args, dict | None):
        return json.dumps({"error": f"{name} takes a JSON object of arguments, "
                                    f"got {type(args).__name__}"})
    try:
        result = handler(scope, dict(args or {}))
    except (ValueError, ClientError) as exc:
        return json.dumps({"error": str(exc)})
    return json.dumps(result, ensure_ascii=False)
