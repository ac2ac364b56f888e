"""The store ops a checked extraction plan turns into: pure, over what was fetched beforehand."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import numpy as np

from services.extractor.parse import FactOp, PageOp, Plan
from services.extractor.prompt import page_content, page_metadata
from shared.layers import EXPERIENCE
from shared.pages import MAX_PAGE_HISTORY, current_state, meta_of, state_values
from shared.pb import common_pb2, store_pb2
from shared.store_client import retire_op, update_op
from shared.text import may_name_one_entity, may_restate, value_key
from shared.tombstones import tombstones

# A new value this close to a forgotten one counts as the forgotten one said again, when its
# words may restate it (shared.text.may_restate: not another number, say).
FORGOTTEN_NEAR = 0.9
ENTITY_LABEL = "entity"


def writers_time(raw: common_pb2.Memory, seconds: float) -> datetime:
    """A time by the writer's clock (its UTC offset: "yesterday" said at 20:00 in Los Angeles
    is the day before there, not in UTC)."""
    return datetime.fromtimestamp(seconds, timezone(timedelta(minutes=raw.utc_offset_minutes)))


def said_at(raw: common_pb2.Memory) -> datetime:
    """When a turn was said, by the writer's clock: its event time when the writer gave one (an
    import or backfill of an older conversation), else when it was written; not when it is
    extracted (catch-up runs hours or days later). A turn is not said after it was written: an
    event time later than that is the date of what it tells of (dated_ahead)."""
    if raw.HasField("event_at") and raw.event_at <= raw.created_at:
        return writers_time(raw, raw.event_at)
    return writers_time(raw, raw.created_at)


def dated_ahead(raw: common_pb2.Memory) -> datetime | None:
    """The event time a writer gave a turn later than when it was written, by its clock: the
    date of what the turn tells of, which lies ahead (a planned event); None otherwise."""
    if raw.HasField("event_at") and raw.event_at > raw.created_at:
        return writers_time(raw, raw.event_at)
    return None


@dataclass
class Turn:
    """What building the ops of one raw row needs, fetched before."""

    raw: common_pb2.Memory
    refused: set[str]
    """Value keys forgotten on this row's evidence (tombstones)."""
    refused_vectors: np.ndarray
    """One per refused key, in the keys' sorted order."""
    vectors: np.ndarray
    """One per new fact, then one per experience, in plan order."""
    vectors_model: str
    dedupe_score: float
    open_intentions: frozenset[str] = frozenset()
    """Value keys of all the owner's open intentions, not only the ones the model was shown."""
    settled: frozenset[str] = frozenset()
    """Value keys of the rows learnt from this row before, live or retired by a later decision:
    a re-extraction does not write them again."""


def _event_at(fact: FactOp, turn_offset_minutes: int) -> tuple[float, int] | None:
    """A new fact's event time with the UTC offset of the writer whose clock it is on: the one
    the model gave, on the turn's writer's clock, else that of the fact it updates (a repeat or
    more detail of it: the fact said again is still of that date), with that fact's offset, as
    the store's restatement carries them over."""
    if fact.event_at is not None:
        return fact.event_at, turn_offset_minutes
    if fact.updates is not None and fact.updates.HasField("event_at"):
        return fact.updates.event_at, fact.updates.utc_offset_minutes
    return None


@dataclass
class OpBuilder:
    """Collects inserts first and retirements last, each retirement once."""

    turn: Turn
    ops: list[store_pb2.Op] = field(default_factory=list)
    retired: dict[str, store_pb2.Op] = field(default_factory=dict)
    fed: list[tuple[str, str]] = field(default_factory=list)
    """(text, id) of this turn's new facts: the page lines of the same turn cite them."""
    refused_count: int = 0

    def all_ops(self, page_ops: Sequence[store_pb2.Op] = ()) -> list[store_pb2.Op]:
        """Inserts, then page changes, then retirements."""
        return [*self.ops, *page_ops, *self.retired.values()]

    def base(self, layer: int, content: str, label: str = "") -> store_pb2.NewMemory:
        """A new row of the turn's owner that cites the turn."""
        raw = self.turn.raw
        return store_pb2.NewMemory(
            owner=raw.owner,
            layer=layer,  # type: ignore[arg-type]
            content=content,
            label=label,
            source_ids=[raw.id],
            metadata_json=json.dumps({"extracted_from": raw.id}),
            write_mode=raw.write_mode,
            utc_offset_minutes=raw.utc_offset_minutes,  # said by the turn's writer, on its clock
        )

    def refuses(self, text: str, vector: np.ndarray | None = None) -> bool:
        """Whether a new value may not be written from this evidence: the user forgot it on it
        (counted), or it was learnt from it before and is live or settled since."""
        if self._forgotten(text, vector):
            self.refused_count += 1
            return True
        return value_key(text) in self.turn.settled

    def _forgotten(self, text: str, vector: np.ndarray | None) -> bool:
        """Whether a new value is one the user had forgotten on this evidence (by its key, or
        by its vector when it has one and its words may restate the forgotten one's)."""
        if value_key(text) in self.turn.refused:
            return True
        refused = self.turn.refused_vectors
        if vector is None or not refused.shape[0]:
            return False
        near = max(self.turn.dedupe_score, FORGOTTEN_NEAR)
        cosines = (refused @ vector).tolist()
        keys = sorted(self.turn.refused)
        return any(c >= near and may_restate(k, text) for k, c in zip(keys, cosines, strict=True))

    def retire(self, memory: common_pb2.Memory, how: str, by: str = "", why: str = "") -> None:
        """Retires a row once (the store keeps a preference fact's L1 mirror in step)."""
        if memory.id not in self.retired:
            self.retired[memory.id] = retire_op(memory.id, how, by, why)

    def _with_vector(self, row: store_pb2.NewMemory, vector: np.ndarray) -> store_pb2.Op:
        # Embedded here for the forgotten-value check: the store takes it as it is.
        row.vector.extend(vector.tolist())
        row.vector_model_id = self.turn.vectors_model
        return store_pb2.Op(insert=row)

    def add_facts(self, plan: Plan) -> None:
        """New facts (the store retires what each restates), and what they replace or update;
        a fact the reply wrote twice is one row."""
        written: list[tuple[str, np.ndarray, str]] = []
        for i, fact in enumerate(plan.facts):
            vector = self.turn.vectors[i]
            if self.refuses(fact.text, vector):
                continue
            if (ref := self._written_before(written, fact.text, vector)) is not None:
                self._retire_for(fact, ref)
                continue
            row = self.base(common_pb2.L3_FACT, fact.text, fact.label)
            row.ref, row.id, row.count = f"f{i}", str(uuid.uuid4()), 1
            self.fed.append((fact.text, row.id))
            if (dated := _event_at(fact, row.utc_offset_minutes)) is not None:
                row.event_at, row.utc_offset_minutes = dated
            if fact.updates is not None:
                row.count = max(fact.updates.count, 1) + 1
            row.restates_at = self.turn.dedupe_score
            self.ops.append(self._with_vector(row, vector))
            written.append((fact.text, vector, row.ref))
            self._retire_for(fact, row.ref)

    def _retire_for(self, fact: FactOp, ref: str) -> None:
        """Retires what a new fact (its row's ref in this apply) replaces or updates."""
        for old in fact.replaces:
            self.retire(old, "replaced", f"${ref}")
        if fact.updates is not None:
            self.retire(fact.updates, "updated", f"${ref}")

    def _written_before(
        self, written: Sequence[tuple[str, np.ndarray, str]], text: str, vector: np.ndarray
    ) -> str | None:
        """The ref of a fact of this reply that text says again, by the store's restatement
        rule (one value key, or within the dedupe score with words that may restate it), which
        rows inserted together do not meet."""
        key = value_key(text)
        for earlier, earlier_vector, ref in written:
            if value_key(earlier) == key or (
                float(earlier_vector @ vector) >= self.turn.dedupe_score
                and may_restate(earlier, text)
            ):
                return ref
        return None

    def add_experiences(self, plan: Plan) -> None:
        """Lessons learned, kept apart from the facts about the user; one learnt again in
        another turn restates the old copy (the store's restatement rule)."""
        for j, text in enumerate(plan.experiences, start=len(plan.facts)):
            if self.refuses(text, self.turn.vectors[j]):
                continue
            row = self.base(common_pb2.L3_FACT, text, EXPERIENCE)
            row.restates_at = self.turn.dedupe_score
            self.ops.append(self._with_vector(row, self.turn.vectors[j]))

    def add_intentions(self, plan: Plan) -> None:
        """New intentions (not one already open), and the ones the turn closed."""
        open_keys = set(self.turn.open_intentions)
        for intention in plan.intentions:
            key = value_key(intention.text)
            if self.refuses(intention.text):
                continue
            if key in open_keys:
                continue  # the turn continues an intention that is already open
            open_keys.add(key)
            row = self.base(common_pb2.L7_INTENTION, intention.text)
            if intention.due_at is not None:
                row.due_at = intention.due_at
            self.ops.append(store_pb2.Op(insert=row))
        for memory in plan.done:
            self.retire(memory, "done", "", "done")
        for memory in plan.moved_on:
            self.retire(memory, "dropped", "", "moved on")


def page_ops(
    builder: OpBuilder, pages: Sequence[PageOp], known: dict[str, common_pb2.Memory]
) -> list[store_pb2.Op]:
    """Page inserts and updates: a changed state moves the old one into the history.

    Each line cites the facts of its turn that name the entity, so the store marks the line
    stale when they are retired, and rests on its turn and every fact of the turn, so it goes
    stale when any of them is forgotten or deleted (a value the line holds may be in a fact
    that does not name the entity). known: the owner's pages by case-folded entity name.
    """
    ops: list[store_pb2.Op] = []
    seen: set[str] = set()
    day = said_at(builder.turn.raw).strftime("%Y-%m-%d")
    for page_op in pages:
        key = page_op.name.casefold()
        page = _its_page(page_op, known)
        if key in seen or state_values(page_op.name, page_op.state) & builder.turn.refused:
            continue
        if page is not None and page.id in seen:
            continue  # one state per page: a second update would find it changed
        seen.add(key)
        if page is not None:
            seen.add(page.id)
        facts = [i for text, i in builder.fed if key in text.casefold()]
        rests_on = [builder.turn.raw.id, *(i for _, i in builder.fed)]
        if page is None:
            row = builder.base(common_pb2.L8_ENTITY,
                               page_content(page_op.name, page_op.state, []), ENTITY_LABEL)
            row.metadata_json = page_metadata(
                page_op.name, page_op.kind, page_op.state, [], facts, rests_on, day
            )
            ops.append(store_pb2.Op(insert=row))
        elif (op := _page_update(page, page_op, facts, rests_on, day)) is not None:
            ops.append(op)
    return ops


def _its_page(page_op: PageOp, known: dict[str, common_pb2.Memory]) -> common_pb2.Memory | None:
    """The page an entity's new state goes to: the one the model named, unless that page is of
    an entity whose name shares no word with the op's (the model's slip: it would overwrite
    another entity's page), else the owner's page of the op's name, if any."""
    named = page_op.page
    if named is not None and may_name_one_entity(
        page_op.name, str(page_meta(named).get("entity") or "")
    ):
        return named
    return known.get(page_op.name.casefold())


def _page_update(
    page: common_pb2.Memory, page_op: PageOp, facts: list[str], rests_on: list[str], day: str
) -> store_pb2.Op | None:
    """The update of a known page whose state changed (None when it did not), said on day,
    made from the page as read before the model's answer: on condition that it is still so,
    since a line retired, forgotten or deleted meanwhile would come back live in the history
    it copies."""
    meta = page_meta(page)
    name = meta.get("entity") or page_op.name
    state = current_state(page.content, meta)  # a user's edit of the page goes to its history
    if value_key(state) == value_key(page_op.state):
        return None
    history = [h for h in meta.get("history", []) if isinstance(h, dict)]
    if state:
        history.insert(0, _history_entry(page, meta, state))
    del history[MAX_PAGE_HISTORY:]
    kind = page_op.kind or str(meta.get("kind") or "")
    new_meta = json.loads(
        page_metadata(name, kind, page_op.state, history, facts, rests_on, day)
    )
    return update_op(
        page.id,
        content=page_content(name, page_op.state, history),
        metadata_json=json.dumps(new_meta, ensure_ascii=False),
        require=as_read(page),
    )


def as_read(memory: common_pb2.Memory) -> store_pb2.Unchanged:
    """A row as read, for an update that is void once it changed: live, with this text and
    these forget tombstones."""
    return store_pb2.Unchanged(
        content=memory.content, tombstones=tombstones(memory.metadata_json)
    )


def _history_entry(page: common_pb2.Memory, meta: dict[str, Any], state: str) -> dict[str, Any]:
    since = meta.get("since") or datetime.fromtimestamp(
        page.updated_at or page.created_at, UTC
    ).strftime("%Y-%m-%d")
    entry: dict[str, Any] = {"date": str(since), "state": state}
    for cites in ("facts", "rests_on"):
        if isinstance(meta.get(cites), list):
            entry[cites] = meta[cites]
    if meta.get("stale"):
        entry["stale"] = True
    return entry


def page_meta(page: common_pb2.Memory) -> dict[str, Any]:
    """A page's metadata object ({} when unreadable)."""
    return meta_of(page.metadata_json)


def page_name(page: common_pb2.Memory) -> str:
    """The entity a page is about."""
    name = page_meta(page).get("entity")
    if isinstance(name, str) and name.strip():
        return name.strip()
    return page.content.split(":", 1)[0].strip()
