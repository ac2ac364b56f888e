"""Forget tombstones: the values forgotten on a raw row, kept in its metadata under "forgotten"."""

from __future__ import annotations

import json
from typing import Any

TOMBSTONES_KEY = "forgotten"
"""The metadata key of a raw row's tombstones: a list of {"value": <value_key>, "at": <unix s>}."""
MAX_TOMBSTONES = 200
"""The most tombstones one raw row keeps (the newest)."""


def _metadata(metadata_json: str) -> dict[str, Any]:
    try:
        meta = json.loads(metadata_json or "{}")
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def _stones(meta: dict[str, Any]) -> list[dict[str, Any]]:
    stones = meta.get(TOMBSTONES_KEY)
    return [s for s in stones if isinstance(s, dict)] if isinstance(stones, list) else []


def tombstones(metadata_json: str, since: float = 0.0) -> list[str]:
    """The normalised values forgotten on a raw row (at since or later; one of unknown time
    counts as later)."""
    stones = _stones(_metadata(metadata_json))
    return [s["value"] for s in stones if isinstance(s.get("value"), str) and _since(s, since)]


def _since(stone: dict[str, Any], since: float) -> bool:
    at = stone.get("at")
    if isinstance(at, bool) or not isinstance(at, int | float):
        return True
    return at >= since


def with_tombstones(metadata_json: str, values: list[str], at: float) -> str:
    """The metadata with a tombstone for each value it does not hold yet."""
    meta = _metadata(metadata_json)
    stones = _stones(meta)
    have = {s.get("value") for s in stones}
    stones.extend({"value": v, "at": at} for v in values if v not in have)
    meta[TOMBSTONES_KEY] = stones[-MAX_TOMBSTONES:]
    return json.dumps(meta, ensure_ascii=False)


def without_tombstone(metadata_json: str, value: str) -> str | None:
    """The metadata without the value's tombstone; None when it holds none for that value."""
    meta = _metadata(metadata_json)
    stones = _stones(meta)
    kept = [s for s in stones if s.get("value") != value]
    if len(kept) == len(stones):
        return None
    if kept:
        meta[TOMBSTONES_KEY] = kept
    else:
        meta.pop(TOMBSTONES_KEY, None)
    return json.dumps(meta, ensure_ascii=False)
