"""The L1 profile mirror rule: each live preference fact's value has one live L1 row, kept in step
by the store in the same transaction as the change to the fact (whoever made it)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace

from services.store.index import IndexChanges
from services.store.model import ACTIVE, ERASED, RETIRED, MemoryRow
from services.store.rows import Writes
from shared.layers import PREFERENCES
from shared.text import value_key

FACT_LAYER, PROFILE_LAYER = "l3_fact", "l1_profile"
REASON = "profile mirror of a preference fact"


def is_preference_fact(row: MemoryRow | None) -> bool:
    """Whether a row is a fact the profile mirrors."""
    return row is not None and row.layer == FACT_LAYER and row.label == PREFERENCES


@dataclass(frozen=True)
class FactChange:
    """A preference fact that became live, or stopped being live (how, by, reason say why)."""

    fact: MemoryRow
    live: bool
    how: str = ""
    by: str = ""
    reason: str = ""


def _mirror_of(mirror: MemoryRow) -> str:
    return str(json.loads(mirror.metadata_json or "{}").get("mirror_of", ""))


async def _value_live(tx: Writes, row: MemoryRow, key: str) -> bool:
    """Whether a live preference fact of the row's owner holds the value."""
    facts = await tx.owner_rows(row.user_id, row.agent_id, FACT_LAYER, PREFERENCES)
    return any(f.status == ACTIVE and value_key(f.content) == key for f in facts)


async def mirrored_fact_down(tx: Writes, row: MemoryRow) -> str | None:
    """Why a retired profile mirror may not be live again on its own: no preference fact holding
    its value is live (restoring the one it mirrors brings it back); None when it may."""
    fact_id = _mirror_of(row) if row.layer == PROFILE_LAYER else ""
    if not fact_id:
        return None
    if await _value_live(tx, row, value_key(row.content)):
        return None
    fact = await tx.get(fact_id)
    if fact is not None and fact.user_id != row.user_id:
        fact = None  # another user's row (an import may name any id): as if erased
    how = "deleted" if fact is None else fact.superseded_how or "retired"
    return f"it mirrors preference fact {fact_id!r}, which is {how}: restore that instead"


class Mirrors:
    """Applies the mirror rule inside one store transaction."""

    def __init__(self, tx: Writes, actor: str, now: float, changes: IndexChanges) -> None:
        self._tx, self._actor, self._now, self._changes = tx, actor, now, changes

    async def follow(self, fact_changes: list[FactChange]) -> None:
        """Mirrors the facts that became live; retires (or erases) mirrors of values now gone."""
        for change in fact_changes:
            rows = await self._tx.owner_rows(
                change.fact.user_id, change.fact.agent_id, PROFILE_LAYER, PREFERENCES
            )
            key = value_key(change.fact.content)
            same = [m for m in rows if value_key(m.content) == key]
            if change.live:
                current = await self._tx.get(change.fact.id)  # a later op may have retired it
                if current is not None and current.status == ACTIVE:
                    await self._mirror(current, same)
                continue
            gone = [] if await _value_live(self._tx, change.fact, key) else [
                m for m in same if m.status == ACTIVE]
            if change.how == ERASED:
                gone += [m for m in same if m not in gone and _mirror_of(m) == change.fact.id]
            await self._retire_all(change, gone)

    async def _mirror(self, fact: MemoryRow, same: list[MemoryRow]) -> None:
        if any(m.status == ACTIVE for m in same):
            return
        # The fact's own mirror retired along with it comes back, history and all.
        own = [m for m in same if _mirror_of(m) == fact.id]
        if own:
            await self._set(own[-1], status=ACTIVE, invalid_at=None, superseded_by="",
                            superseded_how="", drop_reason="", retired_by="")
            return
        vector = await self._tx.vector(fact.id)
        row = replace(
            fact,
            id=str(uuid.uuid4()),
            layer=PROFILE_LAYER,
            metadata_json=json.dumps({"mirror_of": fact.id}),
            created_at=self._now,
            updated_at=self._now,
            hits=0,
            pass_id="",
        )
        self._changes.add(row.user_id, await self._tx.insert(row, vector), vector)
        await self._tx.audit(actor=self._actor, action="insert", row=row, before=None,
                             after=row, reason=REASON, at=self._now)

    async def _retire_all(self, change: FactChange, mirrors: list[MemoryRow]) -> None:
        for mirror in mirrors:
            if change.how == ERASED:
                for key in await self._tx.vector_keys(mirror.id):
                    self._changes.remove(mirror.user_id, key)
                self._changes.remove(mirror.user_id, await self._tx.delete(mirror.id))
                await self._tx.audit(actor=self._actor, action="delete", row=mirror,
                                     before=mirror, after=None, reason=REASON, at=self._now)
                continue
            await self._set(mirror, status=RETIRED, invalid_at=self._now,
                            superseded_by=change.by, superseded_how=change.how,
                            drop_reason=change.reason, retired_by=self._actor)

    async def _set(self, mirror: MemoryRow, **fields: object) -> None:
        action = "restore" if fields.get("status") == ACTIVE else "retire"
        await self._tx.update(mirror.id, {"updated_at": self._now, **fields})
        await self._tx.audit(actor=self._actor, action=action, row=mirror, before=mirror,
                             after=await self._tx.get(mirror.id), reason=REASON, at=self._now)
