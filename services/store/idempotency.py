"""Idempotency keys: a client's retried write is applied once and answered as the first time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.store.model import MemoryRow
from services.store.rows import Writes
from shared.errors import Conflict

KEPT_S = 24 * 3600.0
"""How long a key is remembered; after that the same key makes a new write."""


@dataclass(frozen=True)
class IdempotencyKey:
    """A client's key for one write in one owner's scope, and the hash of that write's ops."""

    user_id: str
    agent_id: str
    key: str
    request_hash: str


@dataclass(frozen=True)
class Replayed:
    """The answer of the earlier write with the same key: one id per op, and each row as it is
    now (None for a delete, or for a row deleted since)."""

    ids: tuple[str, ...]
    rows: tuple[MemoryRow | None, ...]


async def replayed(tx: Writes, key: IdempotencyKey, now: float) -> Replayed | None:
    """The earlier write's answer if the key was used with the same ops; Conflict if it was used
    with other ops; None if it was not used (within KEPT_S)."""
    found = await tx.idempotent_write(key.user_id, key.agent_id, key.key, now - KEPT_S)
    if found is None:
        return None
    request_hash, ids = found
    if request_hash != key.request_hash:
        raise Conflict(
            f"Idempotency-Key {key.key!r} was used for a different request; "
            "send a new key for a new write"
        )
    rows = tuple([await tx.get(memory_id) if memory_id else None for memory_id in ids])
    return Replayed(tuple(ids), rows)


async def record(
    tx: Writes, key: IdempotencyKey, results: Sequence[MemoryRow | None], now: float
) -> None:
    """Records a write's answer under its key, in the write's own transaction (expired keys go)."""
    await tx.forget_idempotent_writes(now - KEPT_S)
    ids = [row.id if row is not None else "" for row in results]
    await tx.record_idempotent_write(
        key.user_id, key.agent_id, key.key, key.request_hash, ids, now
    )
