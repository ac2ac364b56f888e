"""The restatement rule over the facts already stored (admin dedupe_facts): each live fact with a
newer one of the same person and agent at the threshold or above is retired as restated by the
newest."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.store.cascade import restatable, restate_one, restates, settle
from services.store.core import Core
from services.store.model import ACTIVE, ListQuery, MemoryRow, Reach

SAMPLES = 5
REASON = "admin dedupe_facts"


@dataclass
class Dedupe:
    """What a dedupe found, and did unless it was a dry run."""

    dry_run: bool
    threshold: float
    owners: int = 0
    facts: int = 0
    duplicates: int = 0
    sample: list[str] = field(default_factory=list)
    rows_superseded: int = 0


def restated_pairs(rows: list[MemoryRow], vectors: np.ndarray, threshold: float) -> list[
    tuple[MemoryRow, MemoryRow]
]:
    """(older, the newest newer at >= threshold that restates it) for one owner's facts,
    oldest first."""
    scores = vectors @ vectors.T
    pairs, gone = [], set()
    for i in range(len(rows)):
        newer = [
            j for j in range(i + 1, len(rows))
            if j not in gone and scores[i, j] >= threshold and restates(rows[j], rows[i])
        ]
        if newer:
            gone.add(i)
            pairs.append((rows[i], rows[newer[-1]]))
    return pairs


async def _live_facts(core: Core) -> list[MemoryRow]:
    rows = await core.all_rows(Reach(None), ListQuery(layers=("l3_fact",)))
    return [r for r in rows if restatable(r)]


async def dedupe_facts(core: Core, threshold: float, dry_run: bool, actor: str) -> Dedupe:
    """Finds (and unless dry_run retires, in one transaction) the restated facts of everyone."""
    result = Dedupe(dry_run, threshold)
    facts = await _live_facts(core)
    vectors = await core.repo.memory_vectors([f.id for f in facts], core.model.model_id)
    # As at write time: one agent's facts never restate another's.
    owners: dict[tuple[tuple[str, ...], str], list[MemoryRow]] = {}
    for fact in (f for f in facts if f.id in vectors):
        person = tuple(sorted(core.alias_group(fact.user_id)))
        owners.setdefault((person, fact.agent_id), []).append(fact)
    result.owners, result.facts = len(owners), len(facts)
    pairs = [
        pair for rows in owners.values() if len(rows) > 1
        for pair in restated_pairs(rows, np.stack([vectors[r.id] for r in rows]), threshold)
    ]
    result.duplicates = len(pairs)
    result.sample = [f"{old.content[:80]} -> {new.content[:80]}" for old, new in pairs[:SAMPLES]]
    if pairs and not dry_run:
        async with core.writing(actor) as w:
            for old, new in pairs:
                # Retired or erased since it was read: left as it is, and not counted.
                current = await w.tx.get(old.id)
                if current is not None and current.status == ACTIVE:
                    w.facts_changed += await restate_one(w, current, new, REASON)
                    result.rows_superseded += 1
            await settle(w)
    return result
