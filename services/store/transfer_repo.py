"""The SQL of export and import: rows by insertion order with their vectors, keys and history."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiosqlite

from services.store.model import AuditEntry, Edge, MemoryRow, Reach
from services.store.repo import (
    _EDGE_COLUMNS,
    _M_COLUMNS,
    ADD_AUDIT,
    _edge,
    _edge_filters,
    _filters,
    _row,
    _where,
    audit_entry,
    unblob,
)

Owner = tuple[str, str]
"""A row's or an edge's owner: (user id, agent id)."""


@dataclass(frozen=True)
class StoredKey:
    """One extra key of a row as stored: its kind, text and vector (None for a context key)."""

    kind: str
    text: str
    model_id: str
    vector: bytes | None


class TransferRows(ABC):
    """What export and import need of a backend besides rows.Rows and rows.Writes: an export
    reads committed rows, an import reads and writes inside its own write transaction. The SQL
    is written once, with `?` placeholders; a backend gives how it runs it."""

    AMONG: str
    """The SQL after a column that keeps the ids of one list parameter."""
    ADD_CONTEXT_KEY: str
    """Inserts one context key (text, memory id) with the owner its backend keeps on keys."""

    @abstractmethod
    async def _fetch(self, sql: str, params: Sequence[Any]) -> Iterable[Sequence[Any]]:
        """The rows of one statement."""

    @abstractmethod
    async def _execute_many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        """One statement run for each parameter tuple."""

    @abstractmethod
    def _ids(self, ids: Sequence[str]) -> Any:
        """A list of ids as the one parameter AMONG takes."""

    @staticmethod
    @abstractmethod
    def _float32(vector: Any) -> bytes:
        """A stored vector as read back, as little-endian float32 bytes."""

    async def _among(self, sql: str, ids: Sequence[str], **names: str) -> Iterable[Any]:
        return await self._fetch(sql.format(among=self.AMONG, **names), (self._ids(ids),))

    async def rows_after(
        self, reach: Reach, after: int, limit: int
    ) -> list[tuple[int, MemoryRow]]:
        """Rows (live or retired) inside the reach inserted after seq `after`, oldest first."""
        sql, params = rows_after_sql(reach, after, limit)
        return page_rows(await self._fetch(sql, params))

    async def edges_after(self, reach: Reach, after: int, limit: int) -> list[tuple[int, Edge]]:
        """Edges (live, stale or ended; never undone ones) inside the reach after seq `after`."""
        sql, params = edges_after_sql(reach, after, limit)
        return page_edges(await self._fetch(sql, params))

    async def gone_after(
        self, reach: Reach, edges: bool, after: int, limit: int
    ) -> list[tuple[int, tuple[str, str, str]]]:
        """What is gone inside the reach after seq `after`, oldest first: rows deleted for good
        (by the seq of their delete's audit entry; an id a row holds again is not gone), or
        edges undone with their pass. Each with its (id, user id, agent id)."""
        owned, params = reach.sql("" if edges else "a.")
        sql = (GONE_EDGES if edges else GONE_MEMORIES).format(
            owner="".join(f" AND {condition}" for condition in owned)
        )
        return [(r[0], (r[1], r[2], r[3])) for r in await self._fetch(sql, [*params, after, limit])]

    async def vectors_of(self, memory_ids: Sequence[str]) -> dict[str, tuple[str, bytes]]:
        """Each row's own vector: (model id, little-endian float32 bytes)."""
        rows = await self._among(VECTORS_OF, memory_ids)
        return {r[0]: (r[1], self._float32(r[2])) for r in rows}

    async def keys_of(self, memory_ids: Sequence[str]) -> dict[str, list[StoredKey]]:
        """Each row's extra keys: those with a vector in the order they were made, then its
        context key (the order an import writes them in)."""
        return keys_by_memory(await self._among(KEYS_OF, memory_ids), self._float32)

    async def history_of(self, memory_ids: Sequence[str]) -> dict[str, list[AuditEntry]]:
        """Each row's audit entries, oldest first."""
        return history_by_memory(await self._among(HISTORY_OF, memory_ids))

    async def rows_of(self, memory_ids: Sequence[str]) -> dict[str, MemoryRow]:
        """The rows with these ids, live or retired, by id."""
        rows = await self._among(ROWS_OF, memory_ids, columns=_M_COLUMNS)
        return {row.id: row for row in (_row(r) for r in rows)}

    async def edges_of(self, edge_ids: Sequence[str]) -> dict[str, tuple[Edge, bool]]:
        """The edges with these ids by id, each with whether it was undone with its pass."""
        rows = await self._among(EDGES_OF, edge_ids, columns=_EDGE_COLUMNS)
        return {edge.id: (edge, bool(r[-1])) for r in rows for edge in [_edge(r[:-1])]}

    async def memory_owners(self, memory_ids: Sequence[str]) -> dict[str, Owner]:
        """The owner (user id, agent id) of each id among memory_ids that a row has."""
        return await self._owners("memories", memory_ids)

    async def edge_owners(self, edge_ids: Sequence[str]) -> dict[str, Owner]:
        """The owner (user id, agent id) of each id among edge_ids that an edge has."""
        return await self._owners("graph_edges", edge_ids)

    async def _owners(self, table: str, ids: Sequence[str]) -> dict[str, Owner]:
        return {r[0]: (r[1], r[2]) for r in await self._among(OWNERS_AMONG, ids, table=table)}

    async def add_history(self, entries: Sequence[tuple[MemoryRow, AuditEntry]]) -> None:
        """Writes audit entries as they were recorded elsewhere, each under its row's owner."""
        if entries:
            await self._execute_many(ADD_AUDIT, history_params(entries))

    async def drop_history(self, memory_id: str, user_id: str) -> None:
        """Removes a row's audit entries (those recorded under its user), to be written anew."""
        await self._execute_many(DROP_HISTORY, [(memory_id, user_id)])

    async def drop_context_key(self, memory_id: str) -> None:
        """Removes a row's context key, to be written anew."""
        await self._execute_many(DROP_CONTEXT_KEY, [(memory_id,)])

    async def add_context_keys(self, keys: Sequence[tuple[str, str]]) -> None:
        """Gives new rows their context keys as they were: (memory id, text)."""
        if keys:
            await self._execute_many(
                self.ADD_CONTEXT_KEY, [(text, memory_id) for memory_id, text in keys]
            )


def float32(blob: bytes) -> bytes:
    """A stored vector (half precision, or float32 in an older store) as float32 bytes."""
    return unblob(blob).astype("<f4").tobytes()


# The statements both backends share, with SQLite's `?` (pg.db.numbered makes them asyncpg's);
# {among} is how a backend matches a column against a list of ids.
ROWS_AFTER = "SELECT m.seq, {columns} FROM memories m {where} ORDER BY m.seq LIMIT ?"
EDGES_AFTER = "SELECT seq, {columns} FROM graph_edges WHERE {where} ORDER BY seq LIMIT ?"
VECTORS_OF = "SELECT memory_id, model_id, vector FROM vectors WHERE memory_id {among}"
KEYS_OF = (
    "SELECT memory_id, kind, text, model_id, vector FROM memory_keys WHERE memory_id {among} "
    "ORDER BY vector IS NULL, key"
)
HISTORY_OF = (
    "SELECT a.seq, a.at, a.actor, a.action, a.memory_id, a.before_json, a.after_json, a.reason "
    "FROM audit a JOIN memories m ON m.id = a.memory_id AND m.user_id = a.user_id "
    "WHERE a.memory_id {among} ORDER BY a.seq"
)
"""The audit entries of rows, each recorded under the row's user (an erased row's entries stay
apart from a row of another user an import gave its id)."""
ROWS_OF = "SELECT {columns} FROM memories m WHERE m.id {among}"
EDGES_OF = "SELECT {columns}, undone FROM graph_edges WHERE id {among}"
GONE_MEMORIES = (
    "SELECT a.seq, a.memory_id, a.user_id, a.agent_id FROM audit a WHERE a.action = 'delete' "
    "AND NOT EXISTS (SELECT 1 FROM memories m WHERE m.id = a.memory_id){owner} AND a.seq > ? "
    "ORDER BY a.seq LIMIT ?"
)
GONE_EDGES = (
    "SELECT seq, id, user_id, agent_id FROM graph_edges WHERE undone = 1{owner} AND seq > ? "
    "ORDER BY seq LIMIT ?"
)
DROP_HISTORY = "DELETE FROM audit WHERE memory_id = ? AND user_id = ?"
DROP_CONTEXT_KEY = "DELETE FROM memory_keys WHERE memory_id = ? AND kind = 'context'"
OWNERS_AMONG = "SELECT id, user_id, agent_id FROM {table} WHERE id {among}"


def rows_after_sql(reach: Reach, after: int, limit: int) -> tuple[str, list[Any]]:
    """The page of rows after a cursor: statement and parameters."""
    where, params = _filters(reach)
    where.append("m.seq > ?")
    return ROWS_AFTER.format(columns=_M_COLUMNS, where=_where(where)), [*params, after, limit]


def edges_after_sql(reach: Reach, after: int, limit: int) -> tuple[str, list[Any]]:
    """The page of edges after a cursor: statement and parameters."""
    where, params = _edge_filters(reach)
    where.append("seq > ?")
    sql = EDGES_AFTER.format(columns=_EDGE_COLUMNS, where=" AND ".join(where))
    return sql, [*params, after, limit]


def page_rows(rows: Iterable[Sequence[Any]]) -> list[tuple[int, MemoryRow]]:
    """(seq, row) of each result of ROWS_AFTER."""
    return [(r[0], _row(r[1:])) for r in rows]


def page_edges(rows: Iterable[Sequence[Any]]) -> list[tuple[int, Edge]]:
    """(seq, edge) of each result of EDGES_AFTER."""
    return [(r[0], _edge(r[1:])) for r in rows]


def keys_by_memory(
    rows: Iterable[Sequence[Any]], float32: Callable[[Any], bytes]
) -> dict[str, list[StoredKey]]:
    """The results of KEYS_OF by memory id, each vector made float32 bytes by float32."""
    found: dict[str, list[StoredKey]] = {}
    for memory_id, kind, text, model_id, vector in rows:
        blob = None if vector is None else float32(vector)
        found.setdefault(memory_id, []).append(StoredKey(kind, text, model_id, blob))
    return found


def history_by_memory(rows: Iterable[Sequence[Any]]) -> dict[str, list[AuditEntry]]:
    """The results of HISTORY_OF by memory id."""
    found: dict[str, list[AuditEntry]] = {}
    for r in rows:
        found.setdefault(r[4], []).append(audit_entry(r))
    return found


def history_params(entries: Sequence[tuple[MemoryRow, AuditEntry]]) -> list[tuple[Any, ...]]:
    """repo.ADD_AUDIT's parameters, one tuple an entry."""
    return [
        (
            e.at, e.actor, e.action, row.id, row.user_id, row.agent_id, e.before_json,
            e.after_json, e.reason,
        )
        for row, e in entries
    ]


class SqliteTransfer(TransferRows):
    """TransferRows on one SQLite connection: a read snapshot (Repo.read_snapshot) for an
    export, the writer (inside the import's transaction) for an import. A list of ids is one
    JSON parameter; a context key carries its memory's owner key (for the owner-scoped keyword
    index)."""

    AMONG = "IN (SELECT value FROM json_each(?))"
    ADD_CONTEXT_KEY = (
        "INSERT INTO memory_keys (memory_id, kind, text, owner_key) "
        "SELECT id, 'context', ?, owner_key FROM memories WHERE id = ?"
    )

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    async def _fetch(self, sql: str, params: Sequence[Any]) -> Iterable[Sequence[Any]]:
        return await self._conn.execute_fetchall(sql, params)

    async def _execute_many(self, sql: str, params: Sequence[Sequence[Any]]) -> None:
        await self._conn.executemany(sql, params)

    def _ids(self, ids: Sequence[str]) -> Any:
        return json.dumps(list(ids))

    @staticmethod
    def _float32(vector: Any) -> bytes:
        return float32(vector)
