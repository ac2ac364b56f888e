"""The SQL of export and import on PostgreSQL (transfer_repo.TransferRows on asyncpg)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import asyncpg
import numpy as np

from services.store.pg.db import Database, numbered
from services.store.transfer_repo import TransferRows


def _float32(vector: Any) -> bytes:
    """A halfvec as read back (pgvector.HalfVector) as little-endian float32 bytes."""
    return np.asarray(vector.to_numpy(), dtype="<f4").tobytes()


@contextlib.asynccontextmanager
async def one_snapshot(db: Database) -> AsyncIterator[PgTransfer]:
    """TransferRows reading committed rows as of one moment, so the rows, vectors, keys and
    history of an export's page agree while other replicas write."""
    async with (
        db.connection() as conn,
        conn.transaction(isolation="repeatable_read", readonly=True),
    ):
        yield PgTransfer(conn)


class PgTransfer(TransferRows):
    """TransferRows on one connection: in a read-only snapshot for an export, or in the
    import's write transaction. A list of ids is one text[] parameter; a context key carries
    its memory's owner, as every key row here does."""

    AMONG = "= ANY(?::text[])"
    ADD_CONTEXT_KEY = (
        "INSERT INTO memory_keys (memory_id, user_id, kind, text) "
        "SELECT id, user_id, 'context', ? FROM memories WHERE id = ?"
    )

    def __init__(self, on: asyncpg.Connection) -> None:
        self._on = on

    async def _fetch(self, sql: str, params: Sequence[Any]) -> Iterable[Sequence[Any]]:
        return [tuple(r) for r in await self._on.fetch(numbered(sql), *params)]

    async def _execute_many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        await self._on.executemany(numbered(sql), params)

    def _ids(self, ids: Sequence[str]) -> Any:
        return list(ids)

    _float32 = staticmethod(_float32)
