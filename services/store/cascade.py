"""What follows from a retire or restore: derived rows, entity pages, restatements, mirrors,
forget tombstones."""

from __future__ import annotations

import json
from collections.abc import Sequence, Set
from typing import Protocol, TypeVar

import numpy as np

from services.store.core import Write, live_fields, retired_fields
from services.store.keys import passage_of
from services.store.mirrors import FactChange, Mirrors, is_preference_fact
from services.store.model import (
    ACTIVE,
    DERIVED_LAYERS,
    ENTITY,
    ERASED,
    FORGOTTEN,
    KILLS_DERIVED,
    KILLS_SUMMARIES,
    KNOWLEDGE,
    OLD_VERSIONS,
    RAW,
    RETIRED,
    SUMMARY,
    TOMBSTONED,
    Edge,
    MemoryRow,
    Op,
    Reach,
    Restore,
    Retire,
    Update,
)
from services.store.retrieval import vector_search
from shared.layers import EXPERIENCE, ONE_LIVE
from shared.pages import (
    cited_by,
    has_live_line,
    line_values,
    lines_of,
    mark_lines,
    meta_of,
    page_text_of,
    rests_on,
)
from shared.text import may_restate, value_key
from shared.tombstones import held_tombstones, without_tombstone


class _Owned(Protocol):
    @property
    def user_id(self) -> str: ...


T = TypeVar("T", bound=_Owned)


def fact_changes(op: Op, before: MemoryRow, after: MemoryRow | None) -> list[FactChange]:
    """What a retire, restore or update did to the preference facts the profile mirrors."""
    was = is_preference_fact(before) and before.status == ACTIVE
    now_is = is_preference_fact(after) and after is not None and after.status == ACTIVE
    if isinstance(op, Retire) and was:
        return [FactChange(before, False, op.superseded_how, op.superseded_by, op.drop_reason)]
    if isinstance(op, Restore) and now_is and after is not None:
        return [FactChange(after, True)]
    if not isinstance(op, Update) or after is None or (was and now_is and op.content is None):
        return []
    gone = [FactChange(before, False, "updated", after.id)] if was else []
    return gone + ([FactChange(after, True)] if now_is else [])


RESTATE_CANDIDATES = 5
"""The nearest live L3 rows a new one looks through for the nearest of its own kind."""


def restatable(row: MemoryRow) -> bool:
    """Facts, never experiences: the rows the admin dedupe folds together (lessons are kept
    apart)."""
    return row.layer == "l3_fact" and row.label != EXPERIENCE


def same_kind(old: MemoryRow, new: MemoryRow) -> bool:
    """Whether new may restate old: a fact restates a fact and an experience (a lesson learnt
    again) an experience, never one the other."""
    return old.layer == new.layer == "l3_fact" and (old.label == EXPERIENCE) == (
        new.label == EXPERIENCE
    )


NEAR_EXACT = 0.95
"""A row this similar to a value's text holds the same value (a near-exact match) when its
words may restate it (shared.text.may_restate): a phone number or a time one digit apart is
as near as that, and another value."""


def holds_value(key: str, content: str, score: float) -> bool:
    """Whether a row's text, at cosine score from the value's, holds the value (its value_key):
    the same text, case, punctuation and spacing aside, or nearly the same that may restate it."""
    return value_key(content) == key or (score >= NEAR_EXACT and may_restate(key, content))


async def live_copy(w: Write, row: MemoryRow, skip: Set[str] = frozenset()) -> MemoryRow | None:
    """The owner's live fact of a retired fact's kind and agent, not in skip, that holds its
    value (said again while it was retired, say forgotten): the two live would be one memory
    twice."""
    model_id = w.core.model.model_id
    if row.layer != "l3_fact" or row.model_id != model_id:
        return None
    core, vector = w.core, await w.tx.vector(row.id)
    reach = core.reach(row.user_id, row.agent_id)
    hits = await vector_search(
        core, reach, vector.tolist(), model_id, ["l3_fact"], RESTATE_CANDIDATES
    )
    key = value_key(row.content)
    return next(
        (
            h.memory for h in hits
            if h.memory.id != row.id
            and h.memory.id not in skip
            and h.memory.agent_id == row.agent_id
            and same_kind(row, h.memory)
            and holds_value(key, h.memory.content, h.score)
        ),
        None,
    )


async def restate_one(w: Write, old: MemoryRow, new: MemoryRow, reason: str) -> list[FactChange]:
    """Retires old as restated by new, which counts the times old was said on top of its own
    and keeps its date when it gives none (the preference mirror follows)."""
    await w.change(old, "retire", retired_fields(w.now, w.actor, "restated", by=new.id), reason)
    if (current := await w.tx.get(new.id)) is not None:
        await w.change(current, "update", _carried_over(old, current), f"restates {old.id}")
    return [FactChange(old, False, "restated", new.id)] if is_preference_fact(old) else []


def _carried_over(old: MemoryRow, new: MemoryRow) -> dict[str, object]:
    """What a fact said again takes from the one it restates: the times that one was said, and
    its date (with the writer's offset it was read at) when the new one gives none of its own."""
    fields: dict[str, object] = {"count": max(old.count, 1) + max(new.count, 1)}
    if new.event_at is None and old.event_at is not None:
        fields |= {"event_at": old.event_at, "utc_offset_minutes": old.utc_offset_minutes}
    return fields


def restates(new: MemoryRow, old: MemoryRow) -> bool:
    """Whether new may say old's value again, their vectors aside: a row of its kind and of
    its agent (a user's own fact restates no agent's, as consolidation merges none across
    agents) whose words it may restate."""
    return (
        old.agent_id == new.agent_id
        and same_kind(old, new)
        and may_restate(old.content, new.content)
    )


async def restate(
    w: Write, new: MemoryRow, vector: np.ndarray, at: float, spared: set[str]
) -> list[FactChange]:
    """The restatement rule: the owner's live row nearest to a new fact or experience among
    those of its kind whose words it may restate (shared.text.may_restate: not another number or
    word in a word's place), at cosine >= at, is retired as restated by it (not a row this
    Apply names itself)."""
    if new.layer != "l3_fact":
        return []
    core = w.core
    reach = core.reach(new.user_id, new.agent_id)
    hits = await vector_search(
        core, reach, vector.tolist(), core.model.model_id, ["l3_fact"], RESTATE_CANDIDATES, at
    )
    kin = next((h.memory for h in hits if h.memory.id != new.id and restates(new, h.memory)), None)
    old = await w.tx.get(kin.id) if kin is not None else None
    if old is None or old.id in spared or old.status != ACTIVE:
        return []
    return await restate_one(w, old, new, f"restated by {new.id}")


async def settle(w: Write) -> None:
    """Ends every write: the profile follows the preference facts, marked pages are re-rendered."""
    await Mirrors(w.tx, w.actor, w.now, w.changes).follow(w.facts_changed)
    await _render_pages(w)


def _theirs(w: Write, user_id: str, owned: Sequence[T]) -> list[T]:
    """The rows or edges of user_id's person among owned (see Write.same_person)."""
    return [one for one in owned if w.same_person(user_id, one.user_id)]


async def _evidence(w: Write, user_id: str, memory_id: str) -> MemoryRow | None:
    """The row memory_id names as evidence of user_id's rows: None if there is none, or it is
    another person's (as if erased)."""
    row = await w.tx.get(memory_id)
    return row if row is not None and w.same_person(user_id, row.user_id) else None


async def _mark_pages(w: Write, evidence: MemoryRow) -> None:
    """Marks the entity page lines a row fed stale while a row behind them is dead or gone.

    The pages whose marks changed join w.pages, to be rendered again by settle.
    """
    memory_id = evidence.id
    for page in _theirs(w, evidence.user_id, await w.tx.pages_citing(memory_id)):
        meta = meta_of(page.metadata_json)
        lines = [cited_by(line) for line in lines_of(meta)]
        cited = set().union(*(ids for ids in lines if memory_id in ids))
        dead: set[str] = set()
        gone: set[str] = set()
        outdated: set[str] = set()
        for cited_id in cited:
            row = await _evidence(w, page.user_id, cited_id)
            if row is None or (row.status == RETIRED and row.superseded_how == FORGOTTEN):
                gone.add(cited_id)
            if (how := _gone_how(row)) is not None and kills(how, page.layer):
                dead.add(cited_id)
                if how in OLD_VERSIONS:
                    outdated.add(cited_id)
        if not mark_lines(meta, memory_id, dead, gone, outdated):
            continue
        after = json.dumps(meta, ensure_ascii=False, separators=(",", ":"))
        await w.change(
            page, "update", {"metadata": after}, f"page lines fed by {memory_id} marked"
        )
        w.pages.add(page.id)


async def _render_pages(w: Write) -> None:
    """Renders each marked page again from its metadata, leaving out its stale lines, in the
    same transaction as the change that marked them (the new text is embedded here); a page
    with no live line left is retired as stale, and restored when one is live again."""
    for page_id in sorted(w.pages):
        page = await w.tx.get(page_id)
        if page is None:
            continue
        meta = meta_of(page.metadata_json)
        page = await _follow_lines(w, page, has_live_line(meta))
        text = page_text_of(meta)
        if text == page.content:
            continue
        vectors = iter(await w.core.embed([passage_of(text)]))
        await w.new_content(page, text, vectors)
        await w.change(
            page, "update", {"content": text, "model_id": w.core.model.model_id},
            "page re-rendered",
        )


async def _follow_lines(w: Write, page: MemoryRow, live: bool) -> MemoryRow:
    """Retires a live page with no live line as stale, or restores a stale one with one (not
    while a page written for its entity since stands: an entity has one live page)."""
    after: MemoryRow | None = page
    if page.status == ACTIVE and not live:
        why = "no line of the page is live"
        fields = retired_fields(w.now, w.actor, "stale", reason=why)
        after = await w.change(page, "retire", fields, why)
        await retire_derived(w, page, "stale")
    elif (
        page.status == RETIRED and page.superseded_how == "stale" and live
        and await another_page(w, page) is None
    ):
        after = await w.change(page, "restore", live_fields(), "a line of the page is live again")
        await restore_derived(w, page)
    return after or page


def entity_of(page: MemoryRow) -> str:
    """The name of a page's entity as pages are told apart (case aside)."""
    return str(meta_of(page.metadata_json).get("entity") or "").casefold()


async def another_page(w: Write, page: MemoryRow) -> MemoryRow | None:
    """Another live page of the owner about the page's entity, if any."""
    name = entity_of(page)
    reach = w.core.reach(page.user_id, page.agent_id)
    return next(
        (
            other
            for other in await w.tx.rows_in(reach, [ENTITY])
            if other.id != page.id and other.status == ACTIVE and entity_of(other) == name
        ),
        None,
    )


def kills(how: str, layer: str) -> bool:
    """Whether evidence gone this way (a retire's superseded_how, ERASED or TOMBSTONED) takes
    down a row of this layer derived from it: a summary only when its text may hold a value
    forgotten or deleted; an L5/L6 row whenever its evidence no longer stands."""
    if layer == SUMMARY:
        return how in KILLS_SUMMARIES
    return _kills_knowledge(how)


def _kills_knowledge(how: str) -> bool:
    """Whether a row gone this way takes down an L5/L6 row resting on it, and the edges resting
    on it (an L5 row's own)."""
    return how in KILLS_DERIVED or how in ("", ERASED)


def _gone_how(evidence: MemoryRow | None, lifted: Set[str] = frozenset()) -> str | None:
    """How a row is gone as evidence (None: it stands), its tombstones of lifted values aside."""
    if evidence is None:
        return ERASED
    if evidence.status == RETIRED:
        return evidence.superseded_how
    return TOMBSTONED if set(held_tombstones(evidence.metadata_json)) - lifted else None


async def retire_derived(w: Write, evidence: MemoryRow, how: str) -> None:
    """Retires as stale the live rows resting on a row that its going this way kills, and
    hides their edges, the row's own (an L5 row's, gone the same way) and the edges with no
    L5 row resting on it (as their row would go).

    Also marks the entity page lines the row fed. Only its person's rows and edges rest on it.
    """
    await _mark_pages(w, evidence)
    memory_id = evidence.id
    why = f"evidence {memory_id} was {how or 'retired'}"
    killed = [memory_id] if _kills_knowledge(how) else []
    gone = list(killed)
    for row in _theirs(w, evidence.user_id, await w.tx.derived_from(memory_id)):
        if row.status != ACTIVE or not kills(how, row.layer):
            continue
        await w.change(row, "retire", retired_fields(w.now, w.actor, "stale", reason=why), why)
        gone.append(row.id)
    await _hide_edges(w, evidence.user_id, gone, killed)


async def _hide_edges(
    w: Write, user_id: str, memory_ids: Sequence[str], fact_ids: Sequence[str]
) -> None:
    """Marks stale user_id's person's edges of memory_ids (their L5 rows) and those with no L5
    row resting on fact_ids."""
    edges = await w.tx.edges_of_memories(memory_ids)
    edges += await w.tx.rowless_edges_on(fact_ids) if fact_ids else []
    for edge in _theirs(w, user_id, edges):
        await w.tx.update_edge(edge.id, stale=1)


async def follow_erased(w: Write, erased: Sequence[MemoryRow]) -> None:
    """What rests on rows just erased goes with them (retire_derived, ERASED: the summaries,
    knowledge, page lines and edges), and a preference fact's L1 mirror follows it."""
    if len(erased) == 1:
        await retire_derived(w, erased[0], ERASED)
    else:
        for row in await _rested_on(w, erased):
            await retire_derived(w, row, ERASED)
        by_user: dict[str, list[str]] = {}
        for row in erased:
            by_user.setdefault(row.user_id, []).append(row.id)
        for user_id, ids in sorted(by_user.items()):
            await _hide_edges(w, user_id, sorted(ids), sorted(ids))
    w.facts_changed += [
        FactChange(row, live=False, how=ERASED) for row in erased if is_preference_fact(row)
    ]


async def _rested_on(w: Write, erased: Sequence[MemoryRow]) -> list[MemoryRow]:
    """The erased rows a live derived row or an entity page of their person rests on: for a
    bulk delete of thousands, the derived rows and pages of their users are read once, not
    once a row."""
    by_id = {row.id: row for row in erased}
    resting: set[str] = set()
    users = tuple({row.user_id for row in erased})
    for row in await w.tx.rows_in(Reach(users), [*DERIVED_LAYERS, ENTITY]):
        if row.layer == ENTITY:
            named = {i for i in by_id.keys() - resting if json.dumps(i) in row.metadata_json}
        elif row.status == ACTIVE:
            named = by_id.keys() & set(row.source_ids)
        else:
            continue
        resting |= {i for i in named if w.same_person(row.user_id, by_id[i].user_id)}
    return [by_id[i] for i in sorted(resting)]


async def retire_if_stillborn(w: Write, row: MemoryRow) -> MemoryRow:
    """Retires as stale a new derived row (summary, knowledge, schema) whose evidence went
    while it was being written, as that going would have had it been written first; the row
    as it is now."""
    if row.layer not in DERIVED_LAYERS or (dead := await dead_evidence(w, row)) is None:
        return row
    why = f"evidence {dead[0]} was {dead[1]}"
    fields = retired_fields(w.now, w.actor, "stale", reason=why)
    return await w.change(row, "retire", fields, why) or row


async def restore_derived(w: Write, evidence: MemoryRow) -> None:
    """Restores the stale rows of its person resting on a row once none of their evidence is
    gone in a way that kills them (a Now page only while no newer one is live).

    Also clears the stale mark of page lines whose facts are all live, of the edges with no L5
    row whose facts all stand, and of the edges of a row live already (stores before _restore
    checked the evidence let a stale row be restored over evidence still retired, leaving its
    edge stale).
    """
    await _mark_pages(w, evidence)
    await _unmark_rowless_edges(w, evidence)
    memory_id = evidence.id
    for row in _theirs(w, evidence.user_id, await w.tx.derived_from(memory_id)):
        if row.status == RETIRED and row.superseded_how != "stale":
            continue
        if await dead_evidence(w, row) is not None:
            continue
        if row.status == ACTIVE:
            await _unmark_edges(w, row)
        elif not await newer_one_live(w, row):
            await revive(w, row, f"evidence {memory_id} was restored")


async def dead_evidence(
    w: Write, row: MemoryRow, lifted: Set[str] = frozenset()
) -> tuple[str, str] | None:
    """The first of a derived row's evidence that keeps it down, and how it went (erased,
    forgotten, ...), as kills says for this row; None when none of it does (a turn's
    tombstones of lifted values, which the row's restore takes off, do not count)."""
    return await _first_dead(w, row.user_id, row.source_ids, row.layer, lifted)


async def _first_dead(
    w: Write, user_id: str, ids: Sequence[str], layer: str, lifted: Set[str] = frozenset()
) -> tuple[str, str] | None:
    for source in dict.fromkeys(ids):
        how = _gone_how(await _evidence(w, user_id, source), lifted)
        if how is not None and kills(how, layer):
            return source, how or "retired"
    return None


async def edge_stands(w: Write, user_id: str, memory_id: str, fact_ids: Sequence[str]) -> bool:
    """Whether a new edge may be live: its L5 row (if any) is, and none of its facts is gone
    in a way that would take an L5 row down. Else it is stored stale: a restore of the
    evidence that brings its row back (or, for an edge with no row, leaves none of its facts
    gone) clears the mark."""
    row = await _evidence(w, user_id, memory_id) if memory_id else None
    if row is not None and row.status != ACTIVE:
        return False
    return await _first_dead(w, user_id, fact_ids, KNOWLEDGE) is None


async def revive(w: Write, row: MemoryRow, reason: str) -> MemoryRow | None:
    """Makes a retired row live again; the edges resting on it are no longer stale."""
    after = await w.change(row, "restore", live_fields(), reason)
    await _unmark_edges(w, row)
    return after


async def _unmark_rowless_edges(w: Write, fact: MemoryRow) -> None:
    """Clears the stale mark of its person's edges with no L5 row resting on a fact whose facts
    all stand again (as edge_stands says for a new edge)."""
    for edge in _theirs(w, fact.user_id, await w.tx.rowless_edges_on([fact.id])):
        if edge.stale and await edge_stands(w, edge.user_id, "", edge.fact_ids):
            await w.tx.update_edge(edge.id, stale=0)


async def edges_on(w: Write, row: MemoryRow) -> list[Edge]:
    """The edges of the row's person whose searchable memory is the row (an L5 row's)."""
    return _theirs(w, row.user_id, await w.tx.edges_of_memories([row.id]))


async def _unmark_edges(w: Write, row: MemoryRow) -> None:
    """Clears the stale mark of the edges resting on a live row."""
    for edge in await edges_on(w, row):
        if edge.stale:
            await w.tx.update_edge(edge.id, stale=0)


async def live_rival(w: Write, row: MemoryRow) -> str | None:
    """Why the row may not be live beside its owner's live rows: another live page of its
    entity, or another live Now page or arc (an owner has one of each live); None when it
    may."""
    if await newer_one_live(w, row):
        return f"another {ONE_LIVE[row.label]} is live (one is live at a time)"
    if row.layer == ENTITY and (other := await another_page(w, row)) is not None:
        return f"page {other.id!r} of its entity is live (an entity has one live page)"
    return None


async def newer_one_live(w: Write, row: MemoryRow) -> bool:
    """Whether a summary the owner has one live row of (a Now page, the arc) has another live
    (built after this one went stale)."""
    if row.layer != SUMMARY or row.label not in ONE_LIVE:
        return False
    rows = await w.tx.owner_rows(row.user_id, row.agent_id, SUMMARY, row.label)
    return any(other.status == ACTIVE and other.id != row.id for other in rows)


def lifted_values(forgotten: MemoryRow) -> set[str]:
    """The values a forgotten row's restore takes off its turns' tombstones: its own, and for an
    entity page those of its live lines (a stale line's value may be forgotten elsewhere)."""
    values = {value_key(forgotten.content)}
    if forgotten.layer == ENTITY:
        values |= line_values(meta_of(forgotten.metadata_json), live_only=True)
    return values


async def lift_tombstones(w: Write, forgotten: MemoryRow, reason: str) -> None:
    """Takes a restored row's lifted_values off the tombstones its forget left on its turns
    (itself, if a turn, and its evidence; for an entity page, the turns its lines rest on), as
    they read now, so extraction may take the values again."""
    values = lifted_values(forgotten)
    turns = ([forgotten.id] if forgotten.layer == RAW else []) + list(forgotten.source_ids)
    if forgotten.layer == ENTITY:
        turns += rests_on(meta_of(forgotten.metadata_json))
    for turn_id in dict.fromkeys(turns):
        turn = await w.tx.get(turn_id)
        if turn is None or turn.layer != RAW or turn.user_id != forgotten.user_id:
            continue
        if await _lift(w, turn, values, reason):
            await restore_derived(w, turn)
    # The guards the forget left on turns then still to be extracted.
    for mark in await w.tx.forget_marks(forgotten.user_id, forgotten.agent_id):
        if mark.layer == RAW and mark.id not in turns:
            await _lift(w, mark, values, reason, guard_only=True)


async def _lift(
    w: Write, turn: MemoryRow, values: Set[str], reason: str, guard_only: bool = False
) -> bool:
    """Takes the values off a turn's tombstones (only its guards, with guard_only); whether
    any was there."""
    metadata, lifted = turn.metadata_json, False
    for value in sorted(values):
        without = without_tombstone(metadata, value, guard_only)
        if without is not None:
            metadata, lifted = without, True
    if lifted:
        await w.change(turn, "update", {"metadata": metadata}, reason)
    return lifted
