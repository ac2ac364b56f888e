"""Checks on what callers send the store, and "$ref" resolution: pure functions."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from services.store.core import VectorModel
from services.store.model import (
    LAYERS,
    LINE_IDS_STATE,
    MAX_LIMIT,
    SUPERSEDED_HOW,
    Delete,
    EndEdge,
    Insert,
    Op,
    PutEdge,
    Reach,
    Restore,
    Retire,
    SetState,
    Tombstone,
    Update,
)
from shared import client_json
from shared.dates import check_on_calendar, rfc3339
from shared.errors import InvalidArgument, PermissionDenied
from shared.layers import EXTRACTION_STATES
from shared.limits import (
    MAX_COUNT,
    check_count,
    check_identity,
    check_key,
    check_name,
    check_text,
    check_utc_offset,
)
from shared.owner_state import is_owners_key
from shared.settings import MODES

DEFAULT_LIMIT = 20
MAX_APPLY_OPS = 5_000
"""The most ops one Apply may carry: one Apply holds the single writer for all of its ops
(15,000 inserts took 18 s, and other writes timed out behind them). Above what the services
send: a consolidation pass at its largest batch of 1,000 facts (a retire each, a merged row per
two, the edges its reply names); the consolidator's cluster upkeep sends 1,000 at most
(consolidator.survey.UPKEEP_OPS)."""


def metadata(text: str, where: str) -> str:
    """metadata_json as compact JSON ("{}" when blank); anything but an object is refused, and
    an object over the API's limits on metadata (depth, NUL characters, lone surrogates, size),
    which an import of the row would refuse."""
    if not text.strip():
        return "{}"
    try:
        value = client_json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"{where}: metadata_json is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: metadata_json must be a JSON object")
    client_json.check_strings(text, value, f"{where}: metadata_json")
    return client_json.check_object(f"{where}: metadata_json", value)


def page_size(limit: int, what: str = "limit") -> int:
    """The page size to use: 0 is the default; above MAX_LIMIT is refused, never cut."""
    if limit < 0:
        raise InvalidArgument(f"{what} must not be negative")
    if limit > MAX_LIMIT:
        raise InvalidArgument(
            f"{what} {limit} is over the maximum of {MAX_LIMIT}; page with offset"
        )
    return limit or DEFAULT_LIMIT


def page_offset(value: int) -> int:
    """A page's offset, refused when negative."""
    if value < 0:
        raise InvalidArgument("offset must not be negative")
    return value


def check_layers(layers: Sequence[str]) -> None:
    """Refuses a layer name the store does not know."""
    for layer in layers:
        if layer not in LAYERS:
            raise InvalidArgument(f"unknown layer {layer!r}")


def check_op_count(ops: Sequence[Op]) -> None:
    """Refuses more ops than one Apply may carry."""
    if len(ops) > MAX_APPLY_OPS:
        raise InvalidArgument(
            f"an Apply takes at most {MAX_APPLY_OPS:,} ops, got {len(ops):,}: split the write"
        )


def check_ids(ids: Sequence[str]) -> None:
    """Refuses more ids than one request may name."""
    if len(ids) > MAX_LIMIT:
        raise InvalidArgument(f"at most {MAX_LIMIT} ids at once, got {len(ids)}")


def _owned(reach: Reach, op: Insert | PutEdge, where: str) -> None:
    check_identity(f"{where}: owner.user_id", op.user_id)
    check_identity(f"{where}: owner.agent_id", op.agent_id)
    if isinstance(op, Insert):
        check_identity(f"{where}: owner.session_id", op.session_id)
    if not reach.contains(op.user_id, op.agent_id):
        raise PermissionDenied(
            f"{where}: owner {op.user_id!r} (agent {op.agent_id!r}) is outside the request scope"
        )


def _insert(op: Insert, reach: Reach, refs: set[str], where: str) -> Op:
    if not op.user_id:
        raise InvalidArgument(f"{where}: insert needs owner.user_id")
    if op.layer not in LAYERS:
        raise InvalidArgument(f"{where}: insert needs a layer (l1_profile..l8_entity)")
    if not op.content.strip():
        raise InvalidArgument(f"{where}: insert needs non-empty content")
    _owned(reach, op, where)
    if op.ref:
        if op.ref in refs:
            raise InvalidArgument(f"{where}: ref {op.ref!r} is used twice")
        refs.add(op.ref)
    if op.id and (
        op.id.startswith("$") or len(op.id) > 128 or not op.id.strip() or "\x00" in op.id
    ):
        raise InvalidArgument(f"{where}: id {op.id!r} is not a usable memory id")
    check_identity(f"{where}: id", op.id)
    _check_ids(op.source_ids, f"{where}: source_ids")
    check_name(f"{where}: pass_id", op.pass_id)
    check_utc_offset(f"{where}: utc_offset_minutes", op.utc_offset_minutes)
    _fields(where, op)
    return replace(op, metadata_json=metadata(op.metadata_json, where))


def _fields(where: str, op: Insert | Update) -> None:
    """What an insert or update stores is what an import of the row would take: text within the
    API's limits and without NUL, names within theirs, counts of 0 or more, times a calendar
    shows (an export of the row then imports)."""
    if op.content is not None:
        check_text(f"{where}: content", op.content)
    if op.label is not None:
        check_name(f"{where}: label", op.label)
    check_states(where, op.extraction_status, getattr(op, "write_mode", None))
    for name in ("count", "hits", "extraction_tries"):
        if (count := getattr(op, name, None)) is not None:
            check_count(f"{where}: {name}", count)
    _times(where, event_at=op.event_at, valid_to=op.valid_to, due_at=op.due_at)


def check_states(where: str, extraction_status: str | None, write_mode: str | None) -> None:
    """A row's extraction status and write mode are ones the services set, or "" (none)."""
    if extraction_status and extraction_status not in EXTRACTION_STATES:
        raise InvalidArgument(
            f"{where}: extraction_status {extraction_status!r} is not one of "
            + ", ".join(EXTRACTION_STATES)
        )
    if write_mode and write_mode not in MODES:
        raise InvalidArgument(
            f"{where}: write_mode {write_mode!r} is not one of {', '.join(MODES)}"
        )


def _times(where: str, **times: float | None) -> None:
    for name, value in times.items():
        if value is not None:
            check_on_calendar(f"{where}: {name}", value)


def _check_ids(ids: Sequence[str], what: str) -> None:
    for one in ids:
        check_name(what, one)


def _put_edge(op: PutEdge, reach: Reach, refs: set[str], where: str) -> Op:
    if not op.user_id:
        raise InvalidArgument(f"{where}: an edge needs owner.user_id")
    if not (op.subject.strip() and op.relation.strip() and op.object.strip()):
        raise InvalidArgument(f"{where}: an edge needs subject, relation and object")
    for name in ("subject", "relation", "object"):
        check_text(f"{where}: {name}", getattr(op, name))
    _owned(reach, op, where)
    _check_ids(op.source_ids, f"{where}: source_ids")
    _check_ids(op.fact_ids, f"{where}: fact_ids")
    check_name(f"{where}: memory_id", op.memory_id)
    check_name(f"{where}: pass_id", op.pass_id)
    if not math.isfinite(op.weight):
        raise InvalidArgument(f"{where}: an edge's weight must be a finite number")
    _times(where, valid_from=op.valid_from, valid_to=op.valid_to)
    check_edge_span(f"{where}: an edge", op.valid_from, op.valid_to)
    return op


def check_edge_span(what: str, begins: float | None, ends: float | None) -> None:
    """An edge ends no earlier than it began (either may be unknown)."""
    if begins is not None and ends is not None and ends < begins:
        raise InvalidArgument(
            f"{what} cannot end ({rfc3339(ends)}) before it began ({rfc3339(begins)})"
        )


def _end_edge(op: EndEdge, reach: Reach, refs: set[str], where: str) -> Op:
    _times(where, valid_to=op.valid_to)
    check_name(f"{where}: pass_id", op.pass_id)
    return op


def _alone(user_id: str) -> tuple[str, ...]:
    return (user_id,)


def _set_state(
    op: SetState,
    reach: Reach,
    refs: set[str],
    where: str,
    fed_by: Callable[[str], tuple[str, ...]] = _alone,
) -> Op:
    if not op.key:
        raise InvalidArgument(f"{where}: set_state needs a key")
    check_key(f"{where}: set_state key", op.key)
    if op.key == LINE_IDS_STATE:
        raise InvalidArgument(f"{where}: {LINE_IDS_STATE!r} is the store's own state key")
    if op.owner is not None:
        user_id, agent_id = op.owner
        if not is_owners_key(op.key, user_id, agent_id):
            raise InvalidArgument(
                f"{where}: set_state key {op.key!r} is no state key of owner {user_id!r} "
                f"(agent {agent_id!r})"
            )
        # What the services keep under an alias group's first id draws on every alias's
        # turns: a caller reaching one alias asks for it (the page is not shown to that caller).
        if not any(reach.contains(user, agent_id) for user in fed_by(user_id)):
            raise PermissionDenied(
                f"{where}: owner {user_id!r} (agent {agent_id!r}) is outside the request scope"
            )
    if op.value_json:
        try:
            client_json.loads(op.value_json)
        except (ValueError, RecursionError) as exc:
            raise InvalidArgument(f"{where}: value_json is not JSON: {exc}") from None
    return op


def check_how(what: str, how: str, retired: bool) -> None:
    """How a row was retired is one the store knows, and a retired row says how: shown with
    none, it would read as live (an import refuses it, so an export of it would not load)."""
    if how and how not in SUPERSEDED_HOW:
        raise InvalidArgument(f"{what} {how!r} is not one of {', '.join(SUPERSEDED_HOW)}")
    if retired and not how:
        raise InvalidArgument(
            f"{what} is required for a retired row: one of {', '.join(SUPERSEDED_HOW)}"
        )


def _retire(op: Retire, reach: Reach, refs: set[str], where: str) -> Op:
    check_how(f"{where}: superseded_how", op.superseded_how, retired=True)
    check_text(f"{where}: drop_reason", op.drop_reason)
    check_name(f"{where}: pass_id", op.pass_id)
    return op


def _update(op: Update, reach: Reach, refs: set[str], where: str) -> Op:
    if op.content is not None and not op.content.strip():
        raise InvalidArgument(f"{where}: content cannot be emptied")
    if op.hits is not None and op.hits_delta:
        raise InvalidArgument(f"{where}: set hits or add hits_delta, not both")
    if abs(op.hits_delta) > MAX_COUNT:
        raise InvalidArgument(f"{where}: hits_delta must lie within ±(2^31 - 1)")
    _fields(where, op)
    if op.metadata_json is not None:
        return replace(op, metadata_json=metadata(op.metadata_json, where))
    return op


def _as_is(op: Op, reach: Reach, refs: set[str], where: str) -> Op:
    return op


_CHECKS: dict[type, Callable[[Any, Reach, set[str], str], Op]] = {
    Insert: _insert,
    PutEdge: _put_edge,
    Retire: _retire,
    Update: _update,
    Restore: _as_is,
    Tombstone: _as_is,
    Delete: _as_is,
    EndEdge: _end_edge,
}
# Ops that name their target by id.
_BY_ID = (Retire, Update, Restore, Tombstone, Delete, EndEdge)


def validated(
    reach: Reach,
    ops: Sequence[Op],
    reason: str = "",
    fed_by: Callable[[str], tuple[str, ...]] = _alone,
) -> list[Op]:
    """The ops (and the reason their audit entries give, as an import of the entries would
    take it), checked one by one, with their metadata made compact JSON; an owner's state key
    is one a caller reaching any user id fed_by the owner's may set (Core.fed_by)."""
    check_text("reason", reason)
    refs: set[str] = set()
    checked: list[Op] = []
    for i, op in enumerate(ops):
        where = f"op {i}"
        if isinstance(op, _BY_ID) and not op.id:
            raise InvalidArgument(f"{where}: id is required")
        if isinstance(op, SetState):
            checked.append(_set_state(op, reach, refs, where, fed_by))
        else:
            checked.append(_CHECKS[type(op)](op, reach, refs, where))
    return checked


def resolved(ops: list[Op], ids: dict[int, str]) -> list[Op]:
    """Replaces "$ref" names with the ids of inserts made earlier in the same Apply."""
    known: dict[str, str] = {}

    def resolve(value: str, where: str) -> str:
        if not value.startswith("$"):
            return value
        if value[1:] not in known:
            raise InvalidArgument(f"{where}: {value!r} names no earlier insert of this Apply")
        return known[value[1:]]

    out: list[Op] = []
    for i, op in enumerate(ops):
        where = f"op {i}"
        if isinstance(op, Insert):
            if op.ref:
                known[op.ref] = ids[i]
        elif isinstance(op, Retire):
            op = replace(
                op,
                id=resolve(op.id, where),
                superseded_by=resolve(op.superseded_by, where),
            )
        elif isinstance(op, PutEdge):
            op = replace(op, memory_id=resolve(op.memory_id, where))
        elif isinstance(op, SetState | EndEdge):
            pass
        else:
            op = replace(op, id=resolve(op.id, where))
        out.append(op)
    return out


def given_vector(op: Insert, model: VectorModel, where: str) -> np.ndarray:
    """The vector an insert brought, checked against the store's model, unit length."""
    if op.vector_model_id != model.model_id:
        raise InvalidArgument(
            f"{where}: the vector comes from model {op.vector_model_id!r} but the store "
            f"holds {model.model_id!r} vectors"
        )
    vector = np.asarray(op.vector, dtype=np.float32)
    norm = float(np.linalg.norm(vector))
    if vector.shape != (model.ndim,) or not np.isfinite(norm) or norm == 0.0:
        raise InvalidArgument(f"{where}: the vector must be {model.ndim} finite numbers")
    return vector / norm
