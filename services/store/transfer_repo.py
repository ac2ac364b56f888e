"""The SQL of export and import: rows by insertion order with their vectors, keys and history."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import aiosqlite

from services.store.model import AuditEntry, Edge, MemoryRow, Reach
from services.store.repo import (
    _EDGE_COLUMNS,
    _M_COLUMNS,
    _edge,
    _edge_filters,
    _filters,
    _row,
    _where,
    unblob,
)


@dataclass(frozen=True)
class StoredKey:
    """One extra key of a row as stored: its kind, text and vector (None for a context key)."""

    kind: str
    text: str
    model_id: str
    vector: bytes | None


def _ids_json(ids: Sequence[str]) -> str:
    return json.dumps(list(ids))


async def rows_after(
    conn: aiosqlite.Connection, reach: Reach, after: int, limit: int
) -> list[tuple[int, MemoryRow]]:
    """Rows (live or retired) inside the reach inserted after seq `after`, oldest first."""
    where, params = _filters(reach)
    where.append("m.seq > ?")
    rows = await conn.execute_fetchall(
        f"SELECT m.seq, {_M_COLUMNS} FROM memories m {_where(where)} ORDER BY m.seq LIMIT ?",
        (*params, after, limit),
    )
    return [(r[0], _row(r[1:])) for r in rows]


async def edges_after(
    conn: aiosqlite.Connection, reach: Reach, after: int, limit: int
) -> list[tuple[int, Edge]]:
    """Edges (live, stale or ended; never undone ones) inside the reach after seq `after`."""
    where, params = _edge_filters(reach)
    where.append("seq > ?")
    rows = await conn.execute_fetchall(
        f"SELECT seq, {_EDGE_COLUMNS} FROM graph_edges WHERE {' AND '.join(where)} "
        "ORDER BY seq LIMIT ?",
        (*params, after, limit),
    )
    return [(r[0], _edge(r[1:])) for r in rows]


def _float32(blob: bytes) -> bytes:
    """A stored vector (half precision, or float32 in an older store) as float32 bytes."""
    return unblob(blob).astype("<f4").tobytes()


async def vectors_of(
    conn: aiosqlite.Connection, memory_ids: Sequence[str]
) -> dict[str, tuple[str, bytes]]:
    """Each row's own vector: (model id, little-endian float32 bytes)."""
    rows = await conn.execute_fetchall(
        "SELECT memory_id, model_id, vector FROM vectors "
        "WHERE memory_id IN (SELECT value FROM json_each(?))",
        (_ids_json(memory_ids),),
    )
    return {r[0]: (r[1], _float32(r[2])) for r in rows}


async def keys_of(
    conn: aiosqlite.Connection, memory_ids: Sequence[str]
) -> dict[str, list[StoredKey]]:
    """Each row's extra keys, in the order they were made."""
    rows = await conn.execute_fetchall(
        "SELECT memory_id, kind, text, model_id, vector FROM memory_keys "
        "WHERE memory_id IN (SELECT value FROM json_each(?)) ORDER BY key",
        (_ids_json(memory_ids),),
    )
    found: dict[str, list[StoredKey]] = {}
    for memory_id, kind, text, model_id, vector in rows:
        blob = None if vector is None else _float32(vector)
        found.setdefault(memory_id, []).append(StoredKey(kind, text, model_id, blob))
    return found


async def history_of(
    conn: aiosqlite.Connection, memory_ids: Sequence[str]
) -> dict[str, list[AuditEntry]]:
    """Each row's audit entries, oldest first."""
    rows = await conn.execute_fetchall(
        "SELECT seq, at, actor, action, memory_id, before_json, after_json, reason FROM audit "
        "WHERE memory_id IN (SELECT value FROM json_each(?)) ORDER BY seq",
        (_ids_json(memory_ids),),
    )
    found: dict[str, list[AuditEntry]] = {}
    for r in rows:
        found.setdefault(r[4], []).append(AuditEntry(*r))
    return found


async def existing_memory_ids(conn: aiosqlite.Connection, memory_ids: Sequence[str]) -> set[str]:
    """The ids among memory_ids that a row has."""
    rows = await conn.execute_fetchall(
        "SELECT id FROM memories WHERE id IN (SELECT value FROM json_each(?))",
        (_ids_json(memory_ids),),
    )
    return {r[0] for r in rows}


async def existing_edge_ids(conn: aiosqlite.Connection, edge_ids: Sequence[str]) -> set[str]:
    """The ids among edge_ids that an edge has."""
    rows = await conn.execute_fetchall(
        "SELECT id FROM graph_edges WHERE id IN (SELECT value FROM json_each(?))",
        (_ids_json(edge_ids),),
    )
    return {r[0] for r in rows}


async def add_history(
    conn: aiosqlite.Connection, entries: Sequence[tuple[MemoryRow, AuditEntry]]
) -> None:
    """Writes audit entries as they were recorded elsewhere, each under its row's owner."""
    await conn.executemany(
        "INSERT INTO audit (at, actor, action, memory_id, user_id, agent_id, before_json, "
        "after_json, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (
                e.at, e.actor, e.action, row.id, row.user_id, row.agent_id, e.before_json,
                e.after_json, e.reason,
            )
            for row, e in entries
        ],
    )


async def add_context_keys(
    conn: aiosqlite.Connection, keys: Sequence[tuple[str, str]]
) -> None:
    """Gives new rows their context keys as they were: (memory id, text)."""
    await conn.executemany(
        "INSERT INTO memory_keys (memory_id, kind, text) VALUES (?, 'context', ?)", keys
    )
