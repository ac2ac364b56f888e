"""The lines of a JSONL export: memory lines, edge lines and gone lines, rendered and checked."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.store.keys import KINDS, MAX_KEY_CHARS, VECTOR_KINDS
from services.store.model import (
    ACTIVE,
    LAYERS,
    RETIRED,
    AuditEntry,
    Edge,
    MemoryRow,
)
from services.store.repo import row_fields
from services.store.transfer_repo import StoredKey
from services.store.validate import check_edge_span, check_how, check_states
from shared import client_json
from shared.dates import check_on_calendar
from shared.errors import InvalidArgument
from shared.export_format import GONE_TYPE, cut_short_reason
from shared.limits import (
    MAX_JSON_DEPTH,
    MAX_NAME_CHARS,
    check_count,
    check_identity,
    check_name,
    check_text,
    check_utc_offset,
)

DEFAULT_LAYER = "l2_raw"
# The columns of a row or an edge that hold a time (unix seconds).
_TIMES = frozenset({
    "created_at", "updated_at", "event_at", "valid_to", "due_at", "invalid_at",
    "recorded_at", "invalidated_at", "valid_from",
})
# Stored vectors are half precision, so an exported one's length is 1 within a few 1e-4.
UNIT_TOLERANCE = 2e-3


@dataclass(frozen=True)
class KeyLine:
    """An extra key a memory line brings: its vector when it can be reused, else None."""

    kind: str
    text: str
    vector: np.ndarray | None


@dataclass(frozen=True)
class MemoryLine:
    """A checked memory line. keys and history are None when the line leaves them out."""

    row: MemoryRow
    vector: np.ndarray | None
    keys: tuple[KeyLine, ...] | None
    history: tuple[AuditEntry, ...] | None
    given: frozenset[str] | None = dataclasses.field(default=None, compare=False)
    """The row's fields the line gives (None: every one); the rest are defaults."""


@dataclass(frozen=True)
class EdgeLine:
    """A checked edge line."""

    edge: Edge
    given: frozenset[str] | None = dataclasses.field(default=None, compare=False)
    """The edge's fields the line gives (None: every one); the rest are defaults."""


GONE_KINDS = ("memory", "edge")
"""What a gone line names: a row deleted for good, or an edge undone with its pass."""


@dataclass(frozen=True)
class GoneLine:
    """A checked gone line: the id (and owner) of a memory or an edge that is gone from the
    exporting store, which a sync import takes away too."""

    kind: str
    id: str
    user_id: str
    agent_id: str


@dataclass(frozen=True)
class LineContext:
    """What checking a line needs besides the line: the store's model and the write's defaults."""

    model_id: str
    ndim: int
    file_model_id: str
    now: float
    extraction_status: str = ""
    write_mode: str = ""
    line_ids: uuid.UUID = uuid.UUID(int=0)
    """The namespace of the ids lines without one get (the store's, LINE_IDS_STATE)."""


# -- rendering --------------------------------------------------------------------------------


def _b64(blob: bytes | None) -> str | None:
    return base64.b64encode(blob).decode("ascii") if blob is not None else None


def history_entry(entry: AuditEntry) -> dict[str, Any]:
    """One audit entry as a line holds it (its rows as objects)."""
    return {
        "at": entry.at,
        "actor": entry.actor,
        "action": entry.action,
        "reason": entry.reason,
        "before": json.loads(entry.before_json) if entry.before_json else None,
        "after": json.loads(entry.after_json) if entry.after_json else None,
    }


def memory_line(
    row: MemoryRow,
    vector: tuple[str, bytes] | None,
    keys: Sequence[StoredKey],
    history: Sequence[AuditEntry],
) -> dict[str, Any]:
    """One row with its vector (and the model that made it), its keys and its audit trail."""
    return {
        "type": "memory",
        "memory": row_fields(row),
        "vector": _b64(vector[1]) if vector else None,
        "model_id": vector[0] if vector else "",
        "keys": [{"kind": k.kind, "text": k.text, "vector": _b64(k.vector)} for k in keys],
        "history": [history_entry(e) for e in history],
    }


def edge_line(edge: Edge) -> dict[str, Any]:
    """One L5 edge with its evidence."""
    fields = dataclasses.asdict(edge)
    fields["source_ids"] = list(edge.source_ids)
    fields["fact_ids"] = list(edge.fact_ids)
    return {"type": "edge", "edge": fields}


def gone_line(kind: str, item_id: str, user_id: str, agent_id: str) -> dict[str, Any]:
    """One memory deleted for good, or one edge undone, by its id and owner."""
    return {
        "type": GONE_TYPE,
        "gone": {"kind": kind, "id": item_id, "user_id": user_id, "agent_id": agent_id},
    }


# -- checking ---------------------------------------------------------------------------------


def _string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string")
    return value


def _integer(name: str, value: Any) -> int:
    return check_count(name, value)  # every integer of a row is a count


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a number (unix seconds for a time)")
    return float(value)


def _optional_number(name: str, value: Any) -> float | None:
    return None if value is None else _number(name, value)


def _strings(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{name} must be a list of strings")
    return tuple(value)


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be true or false")
    return value


def _metadata(name: str, value: Any) -> str:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name} must be a JSON object")
    return client_json.check_object(name, value)  # the API's limits on metadata


# A checker per field whose values are not those of its annotation's checker below.
_BY_NAME: dict[str, Callable[[str, Any], Any]] = {
    "metadata_json": _metadata,
    "utc_offset_minutes": check_utc_offset,  # an int that is no count: west of UTC is negative
}
# A checker per annotation of the row and edge dataclasses, so a new column is covered at once.
_BY_ANNOTATION: dict[str, Callable[[str, Any], Any]] = {
    "str": _string,
    "int": _integer,
    "float": _number,
    "float | None": _optional_number,
    "tuple[str, ...]": _strings,
    "bool": _boolean,
}


def _fields(cls: type, renamed: Mapping[str, str]) -> dict[str, tuple[str, Callable[..., Any]]]:
    """A dataclass's fields by their name in a line: (attribute, checker)."""
    found = {}
    for f in dataclasses.fields(cls):
        name = renamed.get(f.name, f.name)
        check = _BY_NAME.get(f.name) or _BY_ANNOTATION[str(f.type)]
        found[name] = (f.name, check)
    return found


_MEMORY_FIELDS = _fields(MemoryRow, {"metadata_json": "metadata"})
_EDGE_FIELDS = _fields(Edge, {})


def _checked(
    value: Any, what: str, fields: Mapping[str, tuple[str, Callable[..., Any]]]
) -> dict[str, Any]:
    """The known fields of a line's object, checked, under their attribute names."""
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object")
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise InvalidArgument(f"unknown {what} field {unknown[0]!r}")
    return {
        fields[name][0]: fields[name][1](f"{what}.{name}", given)
        for name, given in value.items()
    }


def _required(values: Mapping[str, Any], what: str, names: Sequence[str]) -> None:
    for name in names:
        if not str(values.get(name, "")).strip():
            raise InvalidArgument(f"{what}.{name} is required")


def _check_id(value: str, what: str) -> None:
    if value and (value.startswith("$") or len(value) > MAX_NAME_CHARS or not value.strip()):
        raise InvalidArgument(f"{what}.id {value[:MAX_NAME_CHARS]!r} is not a usable id")


def _check_times(values: Mapping[str, Any], what: str) -> None:
    """An imported time must be one a calendar date shows (the API's pages print them)."""
    for name in _TIMES.intersection(values):
        if values[name] is not None:
            check_on_calendar(f"{what}.{name}", values[name])


# String fields of a row or an edge that are text rather than a name or an id.
_FREE_TEXT = frozenset({"content", "drop_reason", "subject", "relation", "object"})
# Names the API is given to reach a row, which it trims (shared.limits.check_identity).
_IDENTITIES = frozenset({"id", "user_id", "agent_id", "session_id", "superseded_by"})


def _check_lengths(values: Mapping[str, Any], what: str) -> None:
    """The API's limits on names, ids and text hold for imported lines too (a row's metadata
    is checked as it is read)."""
    for name, value in values.items():
        if name == "metadata_json":
            continue
        if isinstance(value, str):
            check = check_identity if name in _IDENTITIES else check_name
            (check_text if name in _FREE_TEXT else check)(f"{what}.{name}", value)
        elif isinstance(value, tuple):  # source_ids, fact_ids
            for one in value:
                check_name(f"{what}.{name}", one)


def _row(value: Any, ctx: LineContext) -> tuple[MemoryRow, frozenset[str]]:
    """The row a line's memory object makes, and the fields it gives."""
    values = _checked(value, "memory", _MEMORY_FIELDS)
    given = frozenset(values)
    _required(values, "memory", ("user_id", "content"))
    _check_id(values.get("id", ""), "memory")
    _check_lengths(values, "memory")
    _check_times(values, "memory")
    layer = values.setdefault("layer", DEFAULT_LAYER)
    if layer not in LAYERS:
        raise InvalidArgument(f"memory.layer {layer!r} is not one of {', '.join(LAYERS)}")
    if values.get("status", ACTIVE) not in (ACTIVE, RETIRED):
        raise InvalidArgument(f"memory.status must be {ACTIVE!r} or {RETIRED!r}")
    check_how(
        "memory.superseded_how", values.get("superseded_how", ""), values.get("status") == RETIRED
    )
    if values.get("superseded_by") and values["superseded_by"] == values.get("id"):
        raise InvalidArgument("memory.superseded_by names the row itself")
    check_states("memory", values.get("extraction_status"), values.get("write_mode"))
    created = values.setdefault("created_at", ctx.now)
    values.setdefault("updated_at", created)
    if layer == DEFAULT_LAYER:
        # What an ordinary write of a raw turn sets.
        values.setdefault("extraction_status", ctx.extraction_status)
        values.setdefault("write_mode", ctx.write_mode)
    values["model_id"] = ctx.model_id
    return MemoryRow(**{"id": "", "agent_id": "", "session_id": "", **values}), given


def _base64(text: Any, what: str) -> bytes:
    """A vector's bytes; InvalidArgument for anything but well-formed base64 text."""
    if not isinstance(text, str):
        raise InvalidArgument(f"{what} must be base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"{what} is not valid base64") from None


def _vector(text: Any, what: str, ctx: LineContext) -> np.ndarray:
    blob = _base64(text, what)
    if len(blob) != 4 * ctx.ndim:
        raise InvalidArgument(f"{what} holds {len(blob) // 4} floats, not {ctx.ndim}")
    vector = np.frombuffer(blob, dtype="<f4").astype(np.float32)
    norm = float(np.linalg.norm(vector))
    if not math.isfinite(norm) or norm == 0.0:
        raise InvalidArgument(f"{what} must be finite and not all zero")
    # A stored vector comes back bit for bit; only one of another length is scaled to unit.
    return vector if abs(norm - 1.0) < UNIT_TOLERANCE else vector / norm


def _reusable(value: Any, what: str, reuse: bool, ctx: LineContext) -> np.ndarray | None:
    """A vector the store can take as it is; None when it must be embedded again."""
    if value is None:
        return None
    if not reuse:
        _base64(value, what)  # another model's vector, embedded again: well-formed still
        return None
    return _vector(value, what, ctx)


def _keys(value: Any, reuse: bool, ctx: LineContext) -> tuple[KeyLine, ...]:
    if not isinstance(value, list):
        raise InvalidArgument("keys must be a list")
    keys = []
    for i, key in enumerate(value):
        what = f"keys[{i}]"
        if not isinstance(key, dict) or key.get("kind") not in KINDS:
            raise InvalidArgument(f"{what} must be an object of kind " + " or ".join(KINDS))
        text = check_text(f"{what}.text", _string(f"{what}.text", key.get("text")), MAX_KEY_CHARS)
        if not text.strip():
            raise InvalidArgument(f"{what}.text is required")
        vector = _reusable(key.get("vector"), f"{what}.vector", reuse, ctx)
        keys.append(KeyLine(key["kind"], text, vector if key["kind"] in VECTOR_KINDS else None))
    return tuple(keys)


def _json_text(value: Any, what: str) -> str:
    """A row as a history entry holds it ("" for none), within the limits a row is: its
    metadata as the API's, its text as check_text, and no deeper than its metadata allows."""
    if value is None:
        return ""
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be an object or null")
    if isinstance(value.get("metadata"), dict):
        _metadata(f"{what}.metadata", value["metadata"])
    client_json.check_depth(value, what, MAX_JSON_DEPTH + 1)  # a row holds its metadata
    for name in _FREE_TEXT.intersection(value):
        if isinstance(value[name], str):
            check_text(f"{what}.{name}", value[name])
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _history(value: Any) -> tuple[AuditEntry, ...]:
    if not isinstance(value, list):
        raise InvalidArgument("history must be a list")
    entries = []
    for i, item in enumerate(value):
        what = f"history[{i}]"
        if not isinstance(item, dict):
            raise InvalidArgument(f"{what} must be an object")
        actor, action = _string(f"{what}.actor", item.get("actor")), item.get("action")
        reason = _string(f"{what}.reason", item.get("reason", ""))
        entries.append(
            AuditEntry(
                seq=0,
                at=_number(f"{what}.at", item.get("at")),
                actor=check_name(f"{what}.actor", actor),
                action=check_name(f"{what}.action", _string(f"{what}.action", action)),
                memory_id="",
                before_json=_json_text(item.get("before"), f"{what}.before"),
                after_json=_json_text(item.get("after"), f"{what}.after"),
                reason=check_text(f"{what}.reason", reason),
            )
        )
    return tuple(entries)


def _memory(line: Mapping[str, Any], ctx: LineContext) -> MemoryLine:
    unknown = sorted(set(line) - {"type", "memory", "vector", "model_id", "keys", "history"})
    if unknown:
        raise InvalidArgument(f"unknown field {unknown[0]!r}")
    row, given = _row(line.get("memory"), ctx)
    model_id = _string("model_id", line.get("model_id") or ctx.file_model_id)
    reuse = model_id == ctx.model_id
    keys = line.get("keys")
    history = line.get("history")
    return MemoryLine(
        row=row,
        vector=_reusable(line.get("vector"), "vector", reuse, ctx),
        keys=None if keys is None else _keys(keys, reuse, ctx),
        history=None if history is None else _history(history),
        given=given,
    )


def _edge(line: Mapping[str, Any], ctx: LineContext) -> EdgeLine:
    if set(line) - {"type", "edge"}:
        raise InvalidArgument(f"unknown field {sorted(set(line) - {'type', 'edge'})[0]!r}")
    values = _checked(line.get("edge"), "edge", _EDGE_FIELDS)
    _required(values, "edge", ("user_id", "subject", "relation", "object"))
    _check_id(values.get("id", ""), "edge")
    _check_lengths(values, "edge")
    _check_times(values, "edge")
    check_edge_span("edge", values.get("valid_from"), values.get("valid_to"))
    defaults = {
        "id": "", "agent_id": "", "weight": 1.0, "source_ids": (), "fact_ids": (),
        "memory_id": "", "recorded_at": ctx.now, "invalidated_at": None, "valid_from": None,
        "valid_to": None, "stale": False, "pass_id": "",
    }
    return EdgeLine(Edge(**{**defaults, **values}), frozenset(values))


def _gone(line: Mapping[str, Any]) -> GoneLine:
    if set(line) - {"type", "gone"}:
        raise InvalidArgument(f"unknown field {sorted(set(line) - {'type', 'gone'})[0]!r}")
    value = line.get("gone")
    if not isinstance(value, dict):
        raise InvalidArgument("gone must be a JSON object")
    names = ("kind", "id", "user_id", "agent_id")
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise InvalidArgument(f"unknown gone field {unknown[0]!r}")
    if value.get("kind") not in GONE_KINDS:
        raise InvalidArgument("gone.kind must be " + " or ".join(map(repr, GONE_KINDS)))
    _required(value, "gone", ("id", "user_id"))
    fields = {
        name: check_identity(f"gone.{name}", _string(f"gone.{name}", value.get(name, "")))
        for name in names[1:]
    }
    _check_id(fields["id"], "gone")
    return GoneLine(value["kind"], **fields)


def parse_line(text: str, ctx: LineContext) -> MemoryLine | EdgeLine | GoneLine:
    """One line of an import, checked; a bad one is refused with the reason."""
    try:
        line = client_json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"not JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument("not JSON: nested deeper than a line may be") from None
    if not isinstance(line, dict):
        raise InvalidArgument("a line must be a JSON object")
    # Every string of the line at once: a lone surrogate is refused here, not by the database.
    client_json.check_strings(text, line, "line")
    kind = line.get("type")
    reason = cut_short_reason(line)
    if reason is not None:
        raise InvalidArgument(f"the export was cut short here: {reason}")
    if kind == "memory":
        return _memory(line, ctx)
    if kind == "edge":
        return _edge(line, ctx)
    if kind == GONE_TYPE:
        return _gone(line)
    raise InvalidArgument(f"type {kind!r} is not 'memory', 'edge' or 'gone'")
