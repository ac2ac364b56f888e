"""The first line of a JSONL export (what it is, its version, the model of its vectors), the
last line of a whole one (how many lines came before it), and the last line of one cut short."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeGuard

from shared.errors import InvalidArgument

FORMAT = "hyatlas-export"
VERSION = 1
GONE_VERSION = 2
"""The version of an export with gone lines: a server from before them (which reads version 1
alone) refuses its header, before it writes anything, where it would refuse every gone line
and skip every changed row a sync replaces (it ignores sync=true)."""
END_TYPE = "end"
GONE_TYPE = "gone"
# An end line is a few dozen bytes; a longer line is not read as one (nor parsed here).
END_LINE_MOST_BYTES = 1024


@dataclass(frozen=True)
class Header:
    """What an export's first line says: its vectors' model, whether it ends with an end
    line (exports written before that line was, on 2026-12-07, do not), and whether it may
    hold gone lines (version 2)."""

    model_id: str
    ends: bool
    gone: bool = False


def header(model_id: str, ndim: int, now: float, gone: bool = False) -> dict[str, Any]:
    """The first line of an export (one with gone lines when gone)."""
    return {
        "format": FORMAT, "version": GONE_VERSION if gone else VERSION, "model_id": model_id,
        "ndim": ndim, "exported_at": now, "end_line": True,
    }


def read_header(text: str) -> Header | None:
    """The header a first line is; None when the line is no header (a memory or edge line).

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
    version = value.get("version")
    # A bool or a float equals 1 in Python (True == 1.0 == 1): a version is a whole number.
    if not _whole(version) or version not in (VERSION, GONE_VERSION):
        raise InvalidArgument(
            f"export version {_as_written(version)} is not {VERSION} or {GONE_VERSION}"
        )
    model_id = value.get("model_id", "")
    if not isinstance(model_id, str):
        raise InvalidArgument("the header's model_id must be a string")
    ends = value.get("end_line", False)
    if not isinstance(ends, bool):
        # Read as false, a cut-short file would pass as whole.
        raise InvalidArgument(f"the header's end_line {_as_written(ends)} is not true or false")
    return Header(model_id, ends, version == GONE_VERSION)


def _whole(value: Any) -> TypeGuard[int]:
    """Whether a parsed JSON value is a whole number (not a bool, a float or a string)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _as_written(value: Any) -> str:
    """A parsed JSON value as the file wrote it (true, 1.0, "1"), for an error."""
    return json.dumps(value, ensure_ascii=False)


def gone_refused(text: str, found: Header | None) -> str | None:
    """Why a line may not be in the file its header begins: a gone line under a header of
    version 1, which holds none (a file without header may hold them); else None."""
    if found is None or found.gone or GONE_TYPE not in text:
        return None
    if _of_type(text, GONE_TYPE) is None:
        return None
    return (
        f"a gone line, but the header says version {VERSION}: an export with gone lines is "
        f"version {GONE_VERSION}"
    )


def _of_type(text: str, kind: str) -> dict[str, Any] | None:
    """The line's object when it is one of that type; else None (a line that is no JSON is
    left to its own check, which reports it)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) and value.get("type") == kind else None


def end(lines: int) -> dict[str, Any]:
    """The last line of an export that went out whole: the lines before it, the header's too."""
    return {"type": END_TYPE, "lines": lines}


def end_count(text: str) -> int | None:
    """The lines an end line counts before it; None when text is no end line. An end line of
    the wrong shape is refused."""
    if len(text) > END_LINE_MOST_BYTES or END_TYPE not in text:
        return None
    value = _of_type(text, END_TYPE)
    if value is None:
        return None
    lines = value.get("lines")
    if (
        set(value) != {"type", "lines"}
        or not _whole(lines)
        or lines < 0
    ):
        raise InvalidArgument(
            'an end line is {"type": "end", "lines": N}, N the lines before it (a whole '
            "number, 0 or more)"
        )
    return lines


def cut_short(message: str) -> dict[str, Any]:
    """The last line of an export stopped after its 200 went out: why it stopped."""
    return {"error": message}


def cut_short_reason(value: Any) -> str | None:
    """Why an export stopped, when a parsed line is its cut_short line; else None."""
    if isinstance(value, dict) and set(value) == {"error"} and isinstance(value["error"], str):
        return value["error"]
    return None
