"""Forget tombstones: the values forgotten on a raw row, kept in its metadata under "forgotten"."""

from __future__ import annotations

import json
from typing import Any

TOMBSTONES_KEY = "forgotten"
"""The metadata key of a raw row's tombstones: a list of {"value": <value_key>, "at": <unix s>},
with "guard": true on a guard (below)."""
GUARD_KEY = "guard"
"""Marks a guard: a value forgotten while the turn was still to be extracted, put there so its
extraction refuses the value, not because the turn is known to hold it."""
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


def held_tombstones(metadata_json: str) -> list[str]:
    """The values forgotten on a raw row that it held (its guards aside): what makes it dead
    evidence for a summary resting on it."""
    stones = _stones(_metadata(metadata_json))
    return [s["value"] for s in stones if isinstance(s.get("value"), str) and not _guard(s)]


def _guard(stone: dict[str, Any]) -> bool:
    return stone.get(GUARD_KEY) is True


def _since(stone: dict[str, Any], since: float) -> bool:
    at = stone.get("at")
    if isinstance(at, bool) or not isinstance(at, int | float):
        return True
    return at >= since


def with_tombstones(
    metadata_json: str, values: list[str], at: float, guard: bool = False
) -> str:
    """The metadata with a tombstone for each value it does not hold yet (as guards, or held:
    a held tombstone takes the place of a guard of its value)."""
    meta = _metadata(metadata_json)
    stones = _stones(meta)
    if not guard:
        stones = [s for s in stones if not (_guard(s) and s.get("value") in values)]
    have = {s.get("value") for s in stones}
    mark: dict[str, Any] = {"at": at} | ({GUARD_KEY: True} if guard else {})
    stones.extend({"value": v} | mark for v in values if v not in have)
    meta[TOMBSTONES_KEY] = stones[-MAX_TOMBSTONES:]
    return json.dumps(meta, ensure_ascii=False)


def without_tombstone(metadata_json: str, value: str, guard_only: bool = False) -> str | None:
    """The metadata without the value's tombstone (only if a guard, with guard_only); None when
    it holds none such for that value."""
    meta = _metadata(metadata_json)
    stones = _stones(meta)
    kept = [s for s in stones if s.get("value") != value or (guard_only and not _guard(s))]
    if len(kept) == len(stones):
        return None
    if kept:
        meta[TOMBSTONES_KEY] = kept
    else:
        meta.pop(TOMBSTONES_KEY, None)
    return json.dumps(meta, ensure_ascii=False)
