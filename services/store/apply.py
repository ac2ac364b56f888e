"""The Apply transaction: ops checked and embedded, then run by one handler per kind."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.store.cascade import (
    dead_evidence,
    fact_changes,
    follow_erased,
    lift_tombstones,
    lifted_values,
    live_copy,
    live_rival,
    restate,
    restore_derived,
    retire_derived,
    retire_if_stillborn,
    revive,
    settle,
)
from services.store.core import (
    DEFAULT_ACTOR,
    Core,
    Write,
    owned,
    retired_fields,
    target,
)
from services.store.erase import erase
from services.store.graph import end_edge, put_edge
from services.store.idempotency import IdempotencyKey, Replayed, record, replayed
from services.store.keys import passage_of
from services.store.mirrors import FactChange, is_preference_fact, mirrored_fact_down
from services.store.model import (
    ACTIVE,
    DERIVED_LAYERS,
    ENTITY,
    FORGOTTEN,
    LEARNT_LAYERS,
    OLD_VERSIONS,
    RAW,
    REPLACED,
    RETIRED,
    TOMBSTONED,
    Delete,
    EndEdge,
    Insert,
    MemoryRow,
    Op,
    PutEdge,
    Reach,
    Restore,
    Retire,
    SetState,
    Tombstone,
    Unchanged,
    Update,
    forgettable,
)
from services.store.validate import check_layers, given_vector, resolved, validated
from shared.errors import Conflict, InvalidArgument
from shared.limits import MAX_COUNT
from shared.pages import has_live_line, meta_of
from shared.passages import Passage
from shared.tombstones import tombstones, with_tombstones


@dataclass
class _Apply:
    """One Apply in progress: its write, and what its ops hand on to the ones after them."""

    write: Write
    reach: Reach
    reason: str
    ids: dict[int, str]
    vectors: Iterator[np.ndarray]
    restating: list[tuple[int, MemoryRow, np.ndarray, float]] = field(default_factory=list)


async def apply_ops(
    core: Core,
    reach: Reach,
    ops: Sequence[Op],
    actor: str = "",
    reason: str = "",
    key: IdempotencyKey | None = None,
) -> list[MemoryRow | None] | Replayed:
    """Applies ops in one transaction: every one of them, or none (None for a delete). With a
    key already used for the same ops, nothing is applied and that write's answer is given."""
    ops = validated(reach, ops, reason, core.fed_by)
    ids = {i: op.id or str(uuid.uuid4()) for i, op in enumerate(ops) if isinstance(op, Insert)}
    ops = resolved(ops, ids)
    passages, wanted = _to_embed(ops)
    model_id = core.model.model_id
    vectors = await core.embed(passages) if passages else np.zeros((0, core.model.ndim))
    vectors = vectors[np.array(wanted, dtype=bool)] if passages else vectors
    results: list[MemoryRow | None] = []
    # Refused if a re-embed changed the model meanwhile (vectors given with ops are checked
    # under the lock).
    async with core.writing(actor or DEFAULT_ACTOR, model_id if passages else "") as w:
        # Checked under the write lock, so a key sent twice at once is applied once.
        if key is not None and (earlier := await replayed(w.tx, key, w.now)) is not None:
            return earlier
        run = _Apply(w, reach, reason, ids, iter(vectors))
        for i, op in enumerate(ops):
            results.append(await _HANDLERS[type(op)](run, i, op))
        spared = {op.id for op in ops if isinstance(op, Retire)} | set(ids.values())
        for i, row, vector, at in run.restating:
            w.facts_changed += await restate(w, row, vector, at, spared)
            # As the restatement left it (its count, the date it kept), answered and recorded.
            if (now := await w.tx.get(row.id)) is not None:
                results[i] = now
        await settle(w)
        if key is not None:
            await record(w.tx, key, results, w.now)
    return results


async def apply_unkeyed(
    core: Core, reach: Reach, ops: Sequence[Op], actor: str, reason: str
) -> list[MemoryRow | None]:
    """apply_ops for the store's own writes, which carry no idempotency key (never replayed)."""
    applied = await apply_ops(core, reach, ops, actor, reason)
    return list(applied.rows) if isinstance(applied, Replayed) else applied


def _to_embed(ops: Sequence[Op]) -> tuple[list[Passage], list[bool]]:
    """The new texts to embed with their clauses as spans, for one call, and which of the rows
    that gives are used (a text whose vector came with its op is not used again)."""
    passages: list[Passage] = []
    wanted: list[bool] = []
    for op in ops:
        if isinstance(op, Insert | Update) and op.content is not None:
            passage = passage_of(op.content)
            given = isinstance(op, Insert) and bool(op.vector)
            if given and not passage.spans:
                continue
            passages.append(passage)
            wanted += [not given, *(True for _ in passage.spans)]
    return passages, wanted


async def _insert(run: _Apply, i: int, op: Insert) -> MemoryRow | None:
    w = run.write
    if op.id and await w.tx.get(op.id) is not None:
        raise Conflict(f"op {i}: memory {op.id!r} already exists")
    row = _new_row(run.ids[i], op, w.now, w.core.model.model_id)
    vector = given_vector(op, w.core.model, f"op {i}") if op.vector else next(run.vectors)
    key = await w.tx.insert(row, vector)
    w.changes.add(row.user_id, key, vector)
    await w.add_keys(row, run.vectors)
    await w.add_fact_keys(row, vector)
    await w.tx.audit(
        actor=w.actor, action="insert", row=row, before=None, after=row,
        reason=run.reason, at=w.now,
    )
    if op.pass_id:
        await w.tx.record_pass_change(op.pass_id, "insert", row.id)
    if is_preference_fact(row):
        w.facts_changed.append(FactChange(row, live=True))
    if op.restates_at > 0:
        run.restating.append((i, row, vector, op.restates_at))
    return await retire_if_stillborn(w, row)


async def _set_state(run: _Apply, i: int, op: SetState) -> MemoryRow | None:
    await run.write.tx.set_state(op.key, op.value_json, run.write.now, op.if_value)
    return None


async def _put_edge(run: _Apply, i: int, op: PutEdge) -> MemoryRow | None:
    await put_edge(run.write, run.reach, op, f"op {i}")
    return None


async def _end_edge(run: _Apply, i: int, op: EndEdge) -> MemoryRow | None:
    await end_edge(run.write, run.reach, op, f"op {i}")
    return None


async def _delete(run: _Apply, i: int, op: Delete) -> MemoryRow | None:
    w = run.write
    before = await target(w.tx, run.reach, op.id)
    await erase(w, before, run.reason)
    await follow_erased(w, [before])
    return None


async def _retire(run: _Apply, i: int, op: Retire) -> MemoryRow | None:
    w = run.write
    if op.forgets and not forgettable(await w.tx.get(op.id)):
        return None
    before = await target(w.tx, run.reach, op.id)
    if before.status == RETIRED and op.forgets:
        return await _forget_old_version(run, before, op)
    if before.status == RETIRED:
        # Checked in the transaction: of two edits of one row sent at once, or an edit and a
        # forget, the second finds it retired, rather than leave two live versions or replace
        # the forget's mark.
        raise Conflict(
            f"op {i}: memory {op.id!r} is retired already ({before.superseded_how or 'retired'})"
        )
    successor = None
    if op.superseded_by:
        if op.superseded_by == op.id:
            raise InvalidArgument(f"op {i}: a memory cannot supersede itself")
        successor = await target(w.tx, run.reach, op.superseded_by)
    fields = retired_fields(
        _ended_at(w.now, before, op.superseded_how, successor), w.actor, op.superseded_how,
        by=op.superseded_by, reason=op.drop_reason,
    )
    if op.pass_id:
        fields["pass_id"] = op.pass_id
    after = await w.change(before, "retire", fields, run.reason)
    if op.pass_id:
        await w.tx.record_pass_change(op.pass_id, "retire", op.id)
    await retire_derived(w, before, op.superseded_how)
    w.facts_changed += fact_changes(op, before, after)
    return after


def _ended_at(now: float, row: MemoryRow, how: str, successor: MemoryRow | None) -> float:
    """When a row a newer version retires stopped holding: when that version says the change
    happened (its event time, past and later than the row's own), else now. An edit that
    keeps the row's event time is a correction, not a change: now."""
    if successor is None or how not in OLD_VERSIONS or successor.event_at is None:
        return now
    earlier = row.event_at is not None and successor.event_at <= row.event_at
    if successor.event_at > now or earlier:
        return now
    return successor.event_at


async def _forget_old_version(run: _Apply, before: MemoryRow, op: Retire) -> MemoryRow | None:
    """Marks an old version forgotten, keeping when and by which row it was replaced (its
    history and a restore read as for any forgotten row); what rests on it goes stale."""
    w = run.write
    fields = {"superseded_how": FORGOTTEN, "drop_reason": op.drop_reason, "retired_by": w.actor}
    after = await w.change(before, "retire", fields, run.reason)
    await retire_derived(w, before, FORGOTTEN)
    return after


async def _restore(run: _Apply, i: int, op: Restore) -> MemoryRow | None:
    w = run.write
    before = await target(w.tx, run.reach, op.id)
    if before.status == ACTIVE:
        raise Conflict(f"op {i}: memory {op.id!r} is not retired")
    live = await _live_successor(w, before)
    if live is not None and before.superseded_how == FORGOTTEN:
        return await _unforget_old_version(run, before)
    if live is not None:
        # Two live versions of one memory would contradict each other.
        raise Conflict(
            f"op {i}: memory {op.id!r} cannot be restored: its replacement {live.id!r} is "
            "live: forget or delete it first"
        )
    if (why := await _kept_down(w, before)) is not None:
        raise Conflict(f"op {i}: memory {op.id!r} cannot be restored: {why}")
    after = await _revive_with_what_rests_on_it(w, before, run.reason)
    if before.superseded_how == FORGOTTEN and before.layer == RAW:
        await _restore_learnt(w, before, op, run.reason)
    w.facts_changed += fact_changes(op, before, after)
    return after


async def _revive_with_what_rests_on_it(
    w: Write, before: MemoryRow, reason: str
) -> MemoryRow | None:
    """Makes a retired row live again with what rests on it; a forgotten one's value leaves
    the tombstones."""
    after = await revive(w, before, reason)
    await restore_derived(w, before)
    if before.superseded_how == FORGOTTEN:
        await lift_tombstones(w, before, reason)
    return after


async def _restore_learnt(w: Write, turn: MemoryRow, op: Restore, reason: str) -> None:
    """Brings back what the turn's forget took with it (forget._learnt_only_from): the rows
    learnt from it forgotten in the same change, unless one may not be live now."""
    for row in await w.tx.derived_from(turn.id, LEARNT_LAYERS):
        if (
            w.same_person(turn.user_id, row.user_id)
            and row.superseded_how == FORGOTTEN
            and row.updated_at == turn.updated_at
            and await _live_successor(w, row) is None
            and await _kept_down(w, row) is None
        ):
            after = await _revive_with_what_rests_on_it(w, row, reason)
            w.facts_changed += fact_changes(op, row, after)


async def _kept_down(w: Write, row: MemoryRow) -> str | None:
    """Why a retired row (with no live replacement) may not be live again; None when it may."""
    lifted = lifted_values(row) if row.superseded_how == FORGOTTEN else set()
    if row.layer in DERIVED_LAYERS and (dead := await dead_evidence(w, row, lifted)) is not None:
        # Live again over evidence still gone, it would bring a forgotten value back.
        return (
            f"it rests on {dead[0]!r}, which is {dead[1]}: restore that instead, and this "
            "comes back with it"
        )
    if (why := await mirrored_fact_down(w.tx, row)) is not None:
        return why
    if (live := await _restored_over(w, row)) is not None:
        return (
            f"a version it replaced was restored after it was retired, and {live.id!r} is "
            "that version live now: forget it first (one version is live at a time)"
        )
    if (copy := await live_copy(w, row)) is not None:
        return (
            f"its value was said again since, and {copy.id!r} holds it live: forget or delete "
            "that one first (one copy is live at a time)"
        )
    if row.layer == ENTITY and not has_live_line(meta_of(row.metadata_json)):
        # Its lines went stale with what they rest on; live, it would be a page of nothing.
        return "no line of the page is live: restore what its lines rest on instead"
    return await live_rival(w, row)


async def _unforget_old_version(run: _Apply, before: MemoryRow) -> MemoryRow | None:
    """Reverses the forget of an old version whose newer one is live: it is an old version
    again (retired as before the forget, not live), and its value leaves the tombstones."""
    w = run.write
    was = json.loads(await w.tx.last_before(before.id) or "{}").get("superseded_how")
    how = was if was in OLD_VERSIONS else REPLACED
    # What rests on it stays retired, as it was while the row was an old version.
    after = await w.change(before, "restore", {"superseded_how": how, "drop_reason": ""},
                           run.reason)
    await lift_tombstones(w, before, run.reason)
    return after


async def _restored_over(w: Write, row: MemoryRow) -> MemoryRow | None:
    """The live version of a row this one replaced or updated (at any depth) that was
    restored while its chain ended in a retired row: the restore cleared its link to this one,
    so it is found by what the restore's audit entry found (its `superseded_by`). Rows a merge
    took are no versions of it: a pass's undo brings them back beside it."""
    for user_id in w.core.alias_group(row.user_id):
        for memory_id, before in await w.tx.restores_of(user_id):
            was = json.loads(before or "{}")
            over = was.get("superseded_by", "") if was.get("superseded_how") in OLD_VERSIONS else ""
            if not over or not await _leads_to(w, over, row.id):
                continue
            restored = await w.tx.get(memory_id)
            if restored is None:
                continue
            live = restored if restored.status == ACTIVE else await _live_successor(w, restored)
            if live is not None:
                return live
    return None


async def _leads_to(w: Write, memory_id: str, end: str) -> bool:
    """Whether the chain of replacements from a row (itself included) reaches end."""
    seen: set[str] = set()
    while memory_id and memory_id not in seen:
        if memory_id == end:
            return True
        seen.add(memory_id)
        found = await w.tx.get(memory_id)
        memory_id = found.superseded_by if found is not None else ""
    return False


async def _live_successor(w: Write, row: MemoryRow) -> MemoryRow | None:
    """The live row at the end of the chain of rows that replaced a retired one, if any (a
    chain that ends in a row forgotten, dropped or erased has none)."""
    seen = {row.id}
    while row.superseded_by and row.superseded_by not in seen:
        successor = await w.tx.get(row.superseded_by)
        if successor is not None and not w.same_person(row.user_id, successor.user_id):
            return None  # another person's row (an import may name any id): as if erased
        if successor is None or successor.status == ACTIVE:
            return successor
        seen.add(successor.id)
        row = successor
    return None


async def _update(run: _Apply, i: int, op: Update) -> MemoryRow | None:
    w = run.write
    # Before the conditions: what they say of a row outside the reach would tell its text.
    await _not_out_of_reach(w, run.reach, op.id)
    if op.require is not None and not await _unchanged(w, op.id, op.require):
        raise Conflict(
            f"op {i}: memory {op.id!r} was retired, edited or given tombstones since it was read"
        )
    if op.if_content is not None and not await _still_holds(w, op.id, op.if_content):
        if op.content is not None:  # the vectors embedded for it go unused
            for _ in range(passage_of(op.content).rows):
                next(run.vectors)
        return None
    before = await target(w.tx, run.reach, op.id)
    if op.content is not None and before.status != ACTIVE:
        # A retired row's text is what it said then (an old version shows under its successor).
        raise Conflict(f"op {i}: memory {op.id!r} is retired: restore it before editing its text")
    fields = _update_fields(op)
    if op.hits_delta:
        fields["hits"] = min(max(before.hits + op.hits_delta, 0), MAX_COUNT)
    if op.content is not None:
        fields["model_id"] = w.core.model.model_id
        await w.new_content(before, op.content, run.vectors)
    after = await w.change(before, "update", fields, run.reason)
    w.facts_changed += fact_changes(op, before, after)
    return after


async def _live(w: Write, memory_id: str) -> MemoryRow | None:
    """The row as it is now, if it is there and live (nobody retired or erased it since the
    caller read it)."""
    row = await w.tx.get(memory_id)
    return row if row is not None and row.status == ACTIVE else None


async def _not_out_of_reach(w: Write, reach: Reach, memory_id: str) -> None:
    """NotFound for a row the reach does not own, as for one that is not there (a row erased
    meanwhile passes: the op's conditions say what became of it)."""
    row = await w.tx.get(memory_id)
    if row is not None:
        owned(reach, memory_id, row)


async def _still_holds(w: Write, memory_id: str, content: str) -> bool:
    """Whether a row is still live with this text (nobody edited it since the caller read it)."""
    row = await _live(w, memory_id)
    return row is not None and row.content == content


async def _unchanged(w: Write, memory_id: str, read: Unchanged) -> bool:
    """Whether a row is still live with the text and forget tombstones the caller read."""
    row = await _live(w, memory_id)
    return (
        row is not None
        and row.content == read.content
        and frozenset(tombstones(row.metadata_json)) == read.tombstones
    )


async def _tombstone(run: _Apply, i: int, op: Tombstone) -> MemoryRow | None:
    w = run.write
    before = await target(w.tx, run.reach, op.id)
    if before.layer != RAW:
        raise InvalidArgument(f"op {i}: only a raw turn holds tombstones")
    marked = with_tombstones(before.metadata_json, list(op.values), w.now, op.guard)
    after = await w.change(before, "update", {"metadata": marked}, run.reason)
    if not op.guard:
        await retire_derived(w, before, TOMBSTONED)
    return after


_HANDLERS: dict[type, Callable[[_Apply, int, Any], Awaitable[MemoryRow | None]]] = {
    Insert: _insert,
    SetState: _set_state,
    PutEdge: _put_edge,
    EndEdge: _end_edge,
    Delete: _delete,
    Retire: _retire,
    Restore: _restore,
    Update: _update,
    Tombstone: _tombstone,
}


def _new_row(memory_id: str, op: Insert, now: float, model_id: str) -> MemoryRow:
    return MemoryRow(
        id=memory_id,
        user_id=op.user_id,
        agent_id=op.agent_id,
        session_id=op.session_id,
        layer=op.layer,
        content=op.content,
        label=op.label,
        count=op.count,
        source_ids=op.source_ids,
        metadata_json=op.metadata_json,
        model_id=model_id,
        created_at=now,
        updated_at=now,
        event_at=op.event_at,
        valid_to=op.valid_to,
        due_at=op.due_at,
        extraction_status=op.extraction_status,
        write_mode=op.write_mode,
        utc_offset_minutes=op.utc_offset_minutes,
        pass_id=op.pass_id,
    )


def _update_fields(op: Update) -> dict[str, Any]:
    fields = {
        "content": op.content,
        "extraction_status": op.extraction_status,
        "extraction_tries": op.extraction_tries,
        "count": op.count,
        "hits": op.hits,
        "metadata": op.metadata_json,
        "event_at": op.event_at,
        "valid_to": op.valid_to,
        "due_at": op.due_at,
        "label": op.label,
    }
    return {name: value for name, value in fields.items() if value is not None}


async def delete_many(core: Core, reach: Reach, layers: Sequence[str], actor: str = "") -> int:
    """Erases every row (live or retired) inside a reach and layers, and what rests on them goes
    as after one delete; returns how many."""
    check_layers(layers)
    async with core.writing(actor or DEFAULT_ACTOR) as w:
        rows = await w.tx.rows_in(reach, layers)
        for row in rows:
            await erase(w, row, "delete_all")
        await follow_erased(w, rows)
        await settle(w)
    return len(rows)
