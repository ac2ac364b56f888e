"""Deleting a row for good: the row, its keys and vectors, its text in history and neighbours."""

from __future__ import annotations

from services.store.core import Write
from services.store.keys import CONTEXT_LAYERS, NEIGHBOUR_GAP_S, context_text
from services.store.model import MemoryRow


async def erase(w: Write, row: MemoryRow, reason: str) -> None:
    """Deletes row with its vector, clause, fact and context keys (and, for a fact, the keys
    it gave the turns it cites); its audit entries keep ids, owner, actor, times and states but
    none of its text; the turns beside it lose it from their context keys. The write merges the
    keyword indexes and checkpoints on commit."""
    beside = await w.tx.turns_beside(row) if row.layer in CONTEXT_LAYERS else (None, None)
    await w.drop_fact_keys(row)
    for key in await w.tx.vector_keys(row.id):
        w.changes.remove(row.user_id, key)
    w.changes.remove(row.user_id, await w.tx.delete(row.id))
    await w.tx.audit(
        actor=w.actor, action="delete", row=row, before=row, after=None, reason=reason, at=w.now,
    )
    await w.tx.scrub_history(row.id)
    for turn in beside:
        if turn is not None:
            await _rekey(w, turn)
    w.erased = True


async def _rekey(w: Write, turn: MemoryRow) -> None:
    """Builds a turn's context key again from the turns now beside it (within the gap)."""
    if await w.tx.context_key(turn.id) is None:
        return
    before, after = await w.tx.turns_beside(turn)
    near_before = before is not None and turn.created_at - before.created_at <= NEIGHBOUR_GAP_S
    near_after = after is not None and after.created_at - turn.created_at <= NEIGHBOUR_GAP_S
    await w.tx.set_context_key(
        turn.id,
        context_text(
            before.content if near_before and before is not None else None,
            turn.content,
            after.content if near_after and after is not None else None,
        ),
    )
