"""Proto memories to the reference's JSON shapes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from shared.dates import rfc3339
from shared.layers import DONE, LAYER_NAMES, layer_name
from shared.pb import common_pb2, search_pb2

CHANNELS = ("pages", "profile", "proactive", "experiences", "normal")


def unix_seconds(seconds: float) -> int:
    """Whole unix seconds; 0 for a stored value that is not a finite number."""
    return int(seconds) if math.isfinite(seconds) else 0


def layer_counts(counts: Mapping[str, int]) -> dict[str, int]:
    """Live rows per layer with all eight layer names present."""
    return {name: int(counts.get(name, 0)) for name in LAYER_NAMES.values()}


def search_item(scored: common_pb2.ScoredMemory) -> dict[str, Any]:
    """One search hit: id, content, cosine score, layer, owner, dates (an intention's due date
    too), what it replaced, and for a schema the facts behind it."""
    memory = scored.memory
    item: dict[str, Any] = {
        "memory_id": memory.id,
        "content": memory.content,
        "score": round(float(scored.score), 6),
        "layer": _layer(memory.layer),
        "gmt_created": unix_seconds(memory.created_at),
        "user_id": memory.owner.user_id,
        "agent_id": memory.owner.agent_id,
    }
    if memory.HasField("event_at"):
        item["event_at"] = unix_seconds(memory.event_at)
    if memory.HasField("due_at"):
        item["due_at"] = unix_seconds(memory.due_at)
    # The writer's clock, as list gives it: the days its dates speak of are this offset's.
    item["utc_offset_minutes"] = memory.utc_offset_minutes
    if memory.label:
        item["label"] = memory.label
    if scored.replaced:
        item["replaced"] = [
            {
                "memory_id": old.id,
                "content": old.content,
                "superseded_how": old.superseded_how,
                "invalid_at": unix_seconds(old.invalid_at) if old.HasField("invalid_at") else 0,
                "source_ids": list(old.source_ids),
            }
            for old in scored.replaced
        ]
    if scored.evidence:
        item["evidence"] = [{"memory_id": e.id, "content": e.content} for e in scored.evidence]
    return item


def search_response(reply: search_pb2.SearchMemoriesResponse) -> dict[str, Any]:
    """The channelled search answer: every channel present, order, and now when there is one."""
    memories: dict[str, list[dict[str, Any]]] = {name: [] for name in CHANNELS}
    for channel in reply.channels:
        memories.setdefault(channel.name, []).extend(search_item(s) for s in channel.items)
    body: dict[str, Any] = {"memories": memories, "order": list(reply.order)}
    if reply.HasField("now"):
        body["now"] = search_item(reply.now)
    return body


def list_item(memory: common_pb2.Memory) -> dict[str, Any]:
    """One row as /api/v1/list shows it; retired rows also say when, by what and how."""
    item: dict[str, Any] = {
        "memory_id": memory.id,
        "content": memory.content,
        "layer": _layer(memory.layer),
        "user_id": memory.owner.user_id,
        "agent_id": memory.owner.agent_id,
        "session_id": memory.owner.session_id,
        "ts": rfc3339(memory.created_at),
        "gmt_created": unix_seconds(memory.created_at),
        "extracted": memory.extraction_status == DONE,
        "extraction_status": memory.extraction_status,
        "label": memory.label,
        "count": memory.count,
    }
    if memory.HasField("event_at"):
        item["event_at"] = unix_seconds(memory.event_at)
    # The writer's clock: the days its text speaks of ("yesterday") are this offset's.
    item["utc_offset_minutes"] = memory.utc_offset_minutes
    if memory.HasField("due_at"):
        item["due_at"] = unix_seconds(memory.due_at)
    if memory.HasField("invalid_at"):
        item["invalid_at"] = rfc3339(memory.invalid_at)
        item["superseded_by"] = memory.superseded_by
        item["superseded_how"] = memory.superseded_how
        if memory.drop_reason:
            item["drop_reason"] = memory.drop_reason
    return item


def list_items(memories: Iterable[common_pb2.Memory]) -> list[dict[str, Any]]:
    """Rows as /api/v1/list shows them."""
    return [list_item(memory) for memory in memories]


def _layer(value: int) -> str:
    return layer_name(value) if value in LAYER_NAMES else ""
