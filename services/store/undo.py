"""Undoing a consolidation pass: its inserts retired, its retires restored, its edges reverted."""

from __future__ import annotations

import json
from collections.abc import Set

from services.store.cascade import (
    dead_evidence,
    edges_on,
    live_copy,
    restore_derived,
    retire_derived,
    revive,
    settle,
)
from services.store.core import DEFAULT_ACTOR, Core, Write, retired_fields
from services.store.mirrors import FactChange, is_preference_fact
from services.store.model import (
    ACTIVE,
    DERIVED_LAYERS,
    FORGOTTEN,
    RAW,
    RETIRED,
    STALE,
    UNDONE,
    MemoryRow,
    Undone,
)
from shared.errors import Conflict, InvalidArgument, NotFound
from shared.text import value_key
from shared.tombstones import tombstones

UNDONE_MARK = "pass_undone"
"""The change an undo records for its pass, last: a pass is undone once. Undone again, its
changes would be reverted over what came after the first undo (a row edited since brought
back beside its new version, an edge a later pass ended made live again)."""


async def undo_pass(core: Core, pass_id: str, actor: str = "") -> Undone:
    """Reverts every change a consolidation pass made, newest first, in one transaction."""
    if not pass_id:
        raise InvalidArgument("pass_id is required")
    undone = Undone()
    async with core.writing(actor or DEFAULT_ACTOR) as w:
        changes = await w.tx.pass_changes(pass_id)
        if not changes:
            raise NotFound(f"pass {pass_id!r} not found (or it changed nothing)")
        if changes[0][0] == UNDONE_MARK:
            raise Conflict(f"pass {pass_id!r} was undone already")
        await w.tx.record_pass_change(pass_id, UNDONE_MARK, "")
        # The pass's own rows are put back as they were before it: none is a live copy.
        own = frozenset(t for kind, t, _ in changes if kind in ("insert", "retire"))
        for kind, target, before_json in changes:
            if kind in ("insert", "retire"):
                await _undo_row(w, undone, pass_id, (kind, target), own)
            else:
                await _undo_edge(w, undone, pass_id, kind, target, before_json)
        await settle(w)
    return undone


async def _undo_row(
    w: Write, undone: Undone, pass_id: str, change: tuple[str, str], own: Set[str]
) -> None:
    """Retires a row the pass inserted (live, or stale: it must not come back with its
    evidence), or restores one it retired unless _kept_down says why it stays retired."""
    kind, target = change
    row = await w.tx.get(target)
    if row is None:
        return
    why = f"undo of pass {pass_id}"
    if kind == "insert" and (row.status == ACTIVE or row.superseded_how == STALE):
        await w.change(row, "retire", retired_fields(w.now, w.actor, UNDONE, reason=why), why)
        undone.undone_ids.append(target)
        await retire_derived(w, row, UNDONE)
        for edge in await edges_on(w, row):
            await w.tx.update_edge(edge.id, undone=1)
    elif kind == "retire" and row.status == RETIRED and row.pass_id == pass_id:
        if (why_kept := await _kept_down(w, undone, row, pass_id, own)) is not None:
            undone.kept_ids.append(target)
            undone.kept_why[target] = why_kept
            return
        await revive(w, row, why)
        undone.restored_ids.append(target)
        await restore_derived(w, row)
    else:
        return
    if is_preference_fact(row):
        w.facts_changed.append(FactChange(row, kind == "retire", UNDONE))


async def _kept_down(
    w: Write, undone: Undone, row: MemoryRow, pass_id: str, own: Set[str]
) -> str | None:
    """Why a row the pass retired stays retired (forgotten since, its value forgotten through
    another row, what replaced it or its evidence gone, its value live in a row not of the
    pass's own), or None when the undo brings it back."""
    if row.superseded_how == FORGOTTEN or await _value_forgotten(w, row):
        return "its value was forgotten since"
    if not await _successor_stands(w, undone, row, pass_id):
        return f"what replaced it, {row.superseded_by!r}, is gone since"
    if row.layer in DERIVED_LAYERS and await dead_evidence(w, row) is not None:
        return "its evidence is gone since"
    if (copy := await live_copy(w, row, own)) is not None:
        # Restore's own rule: brought back, the value would be live twice.
        return f"its value was said again since, and {copy.id!r} holds it live"
    return None


async def _value_forgotten(w: Write, row: MemoryRow) -> bool:
    """Whether the row's value was forgotten for its owner since the row was learnt: held by a
    row of the owner forgotten since, or tombstoned since on one of the owner's turns. A forget
    reaches no row a pass retired, so a copy of the value the pass dropped is left retired, and
    must stay so; a value forgotten before and said again is remembered."""
    key = value_key(row.content)
    for mark in await w.tx.forget_marks(row.user_id, row.agent_id):
        if (
            mark.superseded_how == FORGOTTEN
            and mark.updated_at >= row.created_at
            and value_key(mark.content) == key
        ):
            return True
        if mark.layer == RAW and key in tombstones(mark.metadata_json, row.created_at):
            return True
    return False


async def _successor_stands(w: Write, undone: Undone, row: MemoryRow, pass_id: str) -> bool:
    """Whether the row that replaced a retired one (if any) is live, or retired only by this
    undo (already, or to come: the pass wrote it and it is stale, its evidence gone since): one
    forgotten, replaced or deleted since the pass took its value with it, so the rows merged
    into it stay retired (a forgotten value must not come back)."""
    if not row.superseded_by:
        return True
    successor = await w.tx.get(row.superseded_by)
    return successor is not None and (
        successor.status == ACTIVE
        or successor.id in undone.undone_ids
        or (successor.pass_id == pass_id and successor.superseded_how == STALE)
    )


async def _undo_edge(
    w: Write, undone: Undone, pass_id: str, kind: str, target: str, before_json: str
) -> None:
    """Hides an edge the pass added, or puts back the evidence or end it changed (and the end
    of its L5 row)."""
    edge = await w.tx.get_edge(target)
    if edge is None:
        return
    undone.edge_ids.append(target)
    if kind == "edge_new":
        await w.tx.update_edge(target, undone=1)
    elif kind == "edge_evidence":
        before = json.loads(before_json)
        await w.tx.update_edge(
            target, source_ids=before["source_ids"], fact_ids=before["fact_ids"]
        )
    elif kind == "edge_end":
        before = json.loads(before_json)
        await w.tx.update_edge(target, valid_to=before["valid_to"], invalidated_at=None)
        row = await w.tx.get(edge.memory_id) if "memory_valid_to" in before else None
        if row is not None:
            why = f"undo of pass {pass_id}"
            await w.change(row, "update", {"valid_to": before["memory_valid_to"]}, why)
