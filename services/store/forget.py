"""Forgetting a value: retire the rows that hold it and tombstone it on the turns they came from.

One read of the candidates, one transaction for every change (the tombstones added to each turn's
metadata as it reads inside it, so forgets at once keep every one), again while a row it forgot
got a new version between the two; the extractor later refuses a
value tombstoned on the turn it reads (shared/tombstones). A turn still to be extracted (the
newest GUARDED_TURNS, and an older one near the value or holding its words) is given them too,
as guards, even when nothing holds the value yet: what
it will yield does not exist yet to be forgotten, and an extraction running on it (which
requires its tombstones unchanged) is refused and runs again refusing the value. A guard takes
nothing resting on the turn down (it is not known to hold the value). A memory-tool
forget names a part, not a value, so it tombstones only its entries' turns. Restoring a
forgotten row lifts its tombstones (cascade.lift_tombstones).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from services.store.apply import apply_unkeyed
from services.store.cascade import holds_value
from services.store.core import Core
from services.store.model import (
    ACTIVE,
    ENTITY,
    FORGOTTEN,
    LEARNT_LAYERS,
    RAW,
    ListQuery,
    MemoryRow,
    Op,
    Reach,
    Retire,
    Tombstone,
    forgettable,
)
from services.store.retrieval import keyword_search, vector_search
from shared.errors import InvalidArgument
from shared.layers import UNEXTRACTED
from shared.limits import MAX_NAME_CHARS, check_no_nul
from shared.pages import line_values, meta_of, rests_on
from shared.passages import Passage
from shared.text import value_key

CANDIDATES = 100
CANDIDATE_FLOOR = 0.5
LOOKS = 3
"""The most times a forget reads and writes: again while the rows it forgot had new versions
written between its read and its write, which it has not seen."""
GUARDED_TURNS = 100
"""The most turns still to be extracted that a forget guards because they are the newest: an
extraction in flight is most often of a turn just written. A backlog of thousands (pro awaiting
a key or with no LLM configured, a long outage) would make one forget that many row changes:
10,000 took it past the 8 s write deadline. An older one is guarded when it may hold the value
(_pending_near)."""


MEMORY_TOOL_TARGETS = ("memory", "user")
"""The targets of Hermes's memory tool: its notes, and what it keeps of the user."""


@dataclass(frozen=True)
class Forget:
    """What to forget: exactly one of a text and a row's id."""

    text: str = ""
    memory_id: str = ""
    reason: str = ""
    memory_tool: bool = False
    """The text names a memory-tool entry by a part of it (case-sensitive, as Hermes matches
    it): the live entries containing it are forgotten with the rows extracted from them, not
    the rows holding the text as a value (a part such as "Al" is no value)."""
    target: str = ""
    """With memory_tool: the tool's target whose entries match ("" any; so does an entry
    written without one)."""


@dataclass(frozen=True)
class Forgotten:
    """The rows retired as forgotten (after the change) and the turns given tombstones."""

    memories: list[MemoryRow]
    evidence_ids: list[str]


async def forget(core: Core, reach: Reach, asked: Forget, actor: str) -> Forgotten:
    """Retires every forgettable row in reach holding the value (live ones and old versions of
    them); NotFound for an unknown id."""
    if bool(asked.text.strip()) == bool(asked.memory_id):
        raise InvalidArgument("forget needs exactly one of text and id")
    check_no_nul("text", asked.text)
    if asked.memory_tool and asked.target not in ("", *MEMORY_TOOL_TARGETS):
        # Another would match no entry, and the forget would say nothing was there.
        raise InvalidArgument(
            f"target {asked.target[:MAX_NAME_CHARS]!r} is not one of the memory tool's: "
            + ", ".join(MEMORY_TOOL_TARGETS)
        )
    text, matches = asked.text, {}
    if asked.memory_id:
        row = await core.get(reach, asked.memory_id)
        if not forgettable(row):
            return Forgotten([], [])
        text, matches = row.content, {row.id: row} | await _learnt_only_from(core, reach, row)
    key = value_key(text)
    if not key:
        raise InvalidArgument("text has nothing to match")
    done = Forgotten([], [])
    for _ in range(LOOKS):
        found = await _found(core, reach, asked, text, key, matches)
        if found is None:
            break
        matches, unextracted = found
        rows = await _retire(core, reach, matches, unextracted, key, asked.reason, actor)
        evidence = list(dict.fromkeys(done.evidence_ids + rows.evidence_ids))
        done = Forgotten(done.memories + rows.memories, evidence)
        if not _versions_written_meanwhile(matches, rows.memories):
            break
        matches = {}  # look again by the value: the new versions hold it too
    return done


async def _found(
    core: Core, reach: Reach, asked: Forget, text: str, key: str, known: dict[str, MemoryRow]
) -> tuple[dict[str, MemoryRow], list[MemoryRow]] | None:
    """The rows to retire and the turns still to be extracted to guard; None for neither."""
    if asked.memory_tool and not asked.memory_id:
        matches = await _memory_tool_entries(core, reach, text.strip(), asked.target)
        return (matches, []) if matches else None
    vector = (await core.embed([Passage(text)]))[0]
    matches = known | await _holding(core, reach, vector, key, known)
    matches |= await _pages_holding(core, reach, key, matches)
    matches = _without_evidence(matches, key)
    unextracted = await _unextracted(core, reach)
    seen = {turn.id for turn in unextracted}
    unextracted += [t for t in await _pending_near(core, reach, vector, text) if t.id not in seen]
    return (matches, unextracted) if matches or unextracted else None


def _versions_written_meanwhile(
    matches: dict[str, MemoryRow], retired: list[MemoryRow]
) -> bool:
    """Whether a row live when the forget read it had a new version by its write (an update
    between the two): the forget did not read that version, which may hold the value."""
    return any(
        matches[row.id].status == ACTIVE
        and row.superseded_by
        and row.superseded_by not in matches
        for row in retired
    )


async def _unextracted(core: Core, reach: Reach) -> list[MemoryRow]:
    """The newest live turns in reach still to be extracted, or being extracted now (at most
    GUARDED_TURNS)."""
    found: list[MemoryRow] = []
    for status in sorted(UNEXTRACTED):
        query = ListQuery(layers=(RAW,), extraction_status=status, limit=GUARDED_TURNS)
        found += (await core.repo.list_rows(reach, query)).rows
    found.sort(key=lambda row: row.created_at, reverse=True)
    return found[:GUARDED_TURNS]


async def _pending_near(
    core: Core, reach: Reach, vector: np.ndarray, text: str
) -> list[MemoryRow]:
    """Live turns still to be extracted that may hold the value, however old: among the
    CANDIDATES turns nearest it in meaning (from CANDIDATE_FLOOR) or holding its words (the
    strict keyword rule). A turn of a long backlog extracted after the forget would give the
    value back unless guarded, and what a turn yields comes from what it says."""
    near = await vector_search(
        core, reach, vector.tolist(), core.model.model_id, (RAW,), CANDIDATES, CANDIDATE_FLOOR
    )
    worded = await keyword_search(core.repo, reach, text, (RAW,), CANDIDATES)
    turns = {hit.memory.id: hit.memory for hit in [*near, *worded.hits]}
    return [turn for turn in turns.values() if turn.extraction_status in UNEXTRACTED]


async def _holding(
    core: Core, reach: Reach, vector: np.ndarray, key: str, known: dict[str, MemoryRow]
) -> dict[str, MemoryRow]:
    """Forgettable rows whose text (its vector given) is the value, or nearly the same text
    that may restate it."""
    hits = await vector_search(
        core, reach, vector.tolist(), core.model.model_id, (), CANDIDATES, CANDIDATE_FLOOR,
        include_superseded=True,
    )
    return {
        hit.memory.id: hit.memory
        for hit in hits
        if hit.memory.id not in known
        and forgettable(hit.memory)
        and holds_value(key, hit.memory.content, hit.score)
    }


async def _pages_holding(
    core: Core, reach: Reach, key: str, known: dict[str, MemoryRow]
) -> dict[str, MemoryRow]:
    """Forgettable entity pages with a live line whose state (or "entity: state") is the value:
    a page's text holds many lines, so it is never near enough to one line's value."""
    pages = await core.all_rows(reach, ListQuery(layers=(ENTITY,), include_superseded=True))
    return {
        page.id: page
        for page in pages
        if page.id not in known
        and forgettable(page)
        and key in line_values(meta_of(page.metadata_json), live_only=True)
    }


def _evidence_of(memory: MemoryRow) -> list[str]:
    """The rows a match was learnt from: its source ids, and for a page what its lines rest on."""
    if memory.layer != ENTITY:
        return list(memory.source_ids)
    return [*memory.source_ids, *rests_on(meta_of(memory.metadata_json))]


async def _retire(
    core: Core,
    reach: Reach,
    matches: dict[str, MemoryRow],
    unextracted: list[MemoryRow],
    key: str,
    reason: str,
    actor: str,
) -> Forgotten:
    """One transaction: each match retired as forgotten, each evidence turn and each turn
    still to be extracted tombstoned."""
    evidence = {m.id: None for m in matches.values() if m.layer == RAW}
    evidence |= {source: None for m in matches.values() for source in _evidence_of(m)}
    found = await core.repo.get_many(reach, list(evidence))
    turns = [found[i] for i in evidence if i in found and found[i].layer == RAW]
    values = tuple(sorted({key, *(value_key(m.content) for m in matches.values())} - {""}))
    why = reason or "forgotten on request"
    ops: list[Op] = [
        Retire(m.id, superseded_how=FORGOTTEN, drop_reason=why, forgets=True)
        for m in matches.values()
    ]
    ops += [Tombstone(t.id, values) for t in turns]
    ops += [Tombstone(t.id, values, guard=True) for t in unextracted if t.id not in evidence]
    rows = await apply_unkeyed(core, reach, ops, actor, f"forget: {why}"[:500])
    retired = [row for row in rows[: len(matches)] if row is not None]
    return Forgotten(retired, [t.id for t in turns])


async def _memory_tool_entries(
    core: Core, reach: Reach, part: str, target: str
) -> dict[str, MemoryRow]:
    """Live memory-tool turns of the target whose text contains part, and the rows extracted
    from them."""
    raws = await core.all_rows(reach, ListQuery(layers=(RAW,)))
    entries = {r.id: r for r in raws if part in r.content and _memory_tool_entry(r, target)}
    if not entries:
        return {}
    derived = await core.all_rows(reach, ListQuery(layers=LEARNT_LAYERS))
    return entries | {row.id: row for row in derived if entries.keys() & set(row.source_ids)}


async def _learnt_only_from(core: Core, reach: Reach, turn: MemoryRow) -> dict[str, MemoryRow]:
    """The live rows extracted from a turn (facts, preferences, intentions) that no other
    live row is evidence of: a turn forgotten by id is what it said, and they say it too."""
    if turn.layer != RAW:
        return {}
    query = ListQuery(layers=LEARNT_LAYERS, source_id=turn.id)
    learnt = [row for row in await core.all_rows(reach, query) if forgettable(row)]
    others = {source for row in learnt for source in row.source_ids} - {turn.id}
    found = await core.repo.get_many(reach, list(others))
    live = {memory_id for memory_id, row in found.items() if row.status == ACTIVE}
    return {row.id: row for row in learnt if not live & set(row.source_ids)}


def _without_evidence(matches: dict[str, MemoryRow], key: str) -> dict[str, MemoryRow]:
    """The matches but the turns that only cite the value: a fact is also a key of the turns it
    was learnt from, so they match its text; they are its evidence, tombstoned, not retired."""
    cited = {source for memory in matches.values() for source in memory.source_ids}
    return {
        memory_id: memory
        for memory_id, memory in matches.items()
        if not (memory_id in cited and memory.layer == RAW and value_key(memory.content) != key)
    }


def _memory_tool_entry(raw: MemoryRow, target: str) -> bool:
    """Whether the memory tool wrote the turn, to the target ("" any)."""
    try:
        meta = json.loads(raw.metadata_json or "{}")
    except ValueError:
        return False
    if not isinstance(meta, dict) or meta.get("write_origin") != "memory_tool":
        return False
    return not target or meta.get("target", target) == target
