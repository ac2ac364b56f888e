"""The first line of a JSONL export (what it is, its version, the model of its vectors) and
the last line of one cut short."""

from __future__ import annotations

import json
from typing import Any

from shared.errors import InvalidArgument

FORMAT = "hyatlas-export"
VERSION = 1


def header(model_id: str, ndim: int, now: float) -> dict[str, Any]:
    """The first line of an export."""
    return {
        "format": FORMAT, "version": VERSION, "model_id": model_id, "ndim": ndim,
        "exported_at": now,
    }


def header_model(text: str) -> str | None:
    """The model a first line names; None when the line is no header (a memory or edge line).

    A header of another format or version is refused.
    """
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return None  # the line's own check reports it
    if not isinstance(value, dict) or "format" not in value or "type" in value:
        return None
    if value["format"] != FORMAT:
        raise InvalidArgument(f"format {value['format']!r} is not {FORMAT!r}")
    if value.get("version") != VERSION:
        raise InvalidArgument(f"export version {value.get('version')!r} is not {VERSION}")
    model_id = value.get("model_id", "")
    if not isinstance(model_id, str):
        raise InvalidArgument("the header's model_id must be a string")
    return model_id


def cut_short(message: str) -> dict[str, Any]:
    """The last line of an export stopped after its 200 went out: why it stopped."""
    return {"error": message}


def cut_short_reason(value: Any) -> str | None:
    """Why an export stopped, when a parsed line is its cut_short line; else None."""
    if isinstance(value, dict) and set(value) == {"error"} and isinstance(value["error"], str):
        return value["error"]
    return None
