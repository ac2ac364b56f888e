"""The SQL of export and import on PostgreSQL (transfer_repo.TransferRows on asyncpg)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import numpy as np

from services.store.model import AuditEntry, Edge, MemoryRow, Reach
from services.store.pg.db import Database, numbered
from services.store.transfer_repo import (
    ADD_HISTORY,
    HISTORY_OF,
    IDS_AMONG,
    KEYS_OF,
    VECTORS_OF,
    StoredKey,
    edges_after_sql,
    history_by_memory,
    history_params,
    keys_by_memory,
    page_edges,
    page_rows,
    rows_after_sql,
)

# A list of ids is one text[] parameter; a context key carries its memory's owner, as every
# key row here does.
_AMONG = "= ANY(?::text[])"
_ADD_CONTEXT_KEY = (
    "INSERT INTO memory_keys (memory_id, user_id, kind, text) "
    "SELECT id, user_id, 'context', ? FROM memories WHERE id = ?"
)


def _float32(vector: Any) -> bytes:
    """A halfvec as read back (pgvector.HalfVector) as little-endian float32 bytes."""
    return np.asarray(vector.to_numpy(), dtype="<f4").tobytes()


@contextlib.asynccontextmanager
async def one_snapshot(db: Database) -> AsyncIterator[PgTransfer]:
    """TransferRows reading committed rows as of one moment, so the rows, vectors, keys and
    history of an export's page agree while other replicas write."""
    async with (
        db.pool.acquire() as conn,
        conn.transaction(isolation="repeatable_read", readonly=True),
    ):
        yield PgTransfer(conn)


class PgTransfer:
    """TransferRows on one connection: in a read-only snapshot for an export, or in the
    import's write transaction."""

    def __init__(self, on: asyncpg.Connection) -> None:
        self._on = on

    async def _fetch(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in await self._on.fetch(numbered(sql), *params)]

    async def _among(self, sql: str, ids: Sequence[str], **names: str) -> list[tuple[Any, ...]]:
        return await self._fetch(sql.format(among=_AMONG, **names), list(ids))

    async def rows_after(
        self, reach: Reach, after: int, limit: int
    ) -> list[tuple[int, MemoryRow]]:
        """Rows (live or retired) inside the reach inserted after seq `after`, oldest first."""
        sql, params = rows_after_sql(reach, after, limit)
        return page_rows(await self._fetch(sql, *params))

    async def edges_after(self, reach: Reach, after: int, limit: int) -> list[tuple[int, Edge]]:
        """Edges (live, stale or ended; never undone ones) inside the reach after seq `after`."""
        sql, params = edges_after_sql(reach, after, limit)
        return page_edges(await self._fetch(sql, *params))

    async def vectors_of(self, memory_ids: Sequence[str]) -> dict[str, tuple[str, bytes]]:
        """Each row's own vector: (model id, little-endian float32 bytes)."""
        rows = await self._among(VECTORS_OF, memory_ids)
        return {r[0]: (r[1], _float32(r[2])) for r in rows}

    async def keys_of(self, memory_ids: Sequence[str]) -> dict[str, list[StoredKey]]:
        """Each row's extra keys, in the order they were made."""
        return keys_by_memory(await self._among(KEYS_OF, memory_ids), _float32)

    async def history_of(self, memory_ids: Sequence[str]) -> dict[str, list[AuditEntry]]:
        """Each row's audit entries, oldest first."""
        return history_by_memory(await self._among(HISTORY_OF, memory_ids))

    async def existing_memory_ids(self, memory_ids: Sequence[str]) -> set[str]:
        """The ids among memory_ids that a row has."""
        return {r[0] for r in await self._among(IDS_AMONG, memory_ids, table="memories")}

    async def existing_edge_ids(self, edge_ids: Sequence[str]) -> set[str]:
        """The ids among edge_ids that an edge has."""
        return {r[0] for r in await self._among(IDS_AMONG, edge_ids, table="graph_edges")}

    async def add_history(self, entries: Sequence[tuple[MemoryRow, AuditEntry]]) -> None:
        """Writes audit entries as they were recorded elsewhere, each under its row's owner."""
        if entries:
            await self._on.executemany(numbered(ADD_HISTORY), history_params(entries))

    async def add_context_keys(self, keys: Sequence[tuple[str, str]]) -> None:
        """Gives new rows their context keys as they were: (memory id, text)."""
        if keys:
            await self._on.executemany(
                numbered(_ADD_CONTEXT_KEY), [(text, memory_id) for memory_id, text in keys]
            )
