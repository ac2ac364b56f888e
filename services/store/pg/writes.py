"""Writes inside one PostgreSQL transaction (rows.Writes on an asyncpg connection)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import asyncpg
import numpy as np

from services.store.model import DERIVED_LAYERS, Edge, MemoryRow, Reach
from services.store.off_calendar import DATES, EDGE_DATES
from services.store.pg.db import numbered
from services.store.repo import (
    _COLUMNS,
    _EDGE_COLUMNS,
    _M_COLUMNS,
    ADD_AUDIT,
    ADD_EDGE,
    CLAUSE_KEY_OFFSET,
    EDGES_OFF_CALENDAR,
    FORGET_MARKS,
    FORGET_MARKS_LIKE,
    LAST_BEFORE,
    LIVE_EDGE,
    OFF_CALENDAR,
    RESTORES_OF,
    ROW_WIDTH,
    UPDATABLE_COLUMNS,
    VECTOR_KEYS_OF,
    _edge,
    _erased,
    _filters,
    _row,
    _where,
    conditional_state,
    edge_values,
    row_json,
    rows_of_layers,
)
from shared.errors import Conflict

# A vector or key row carries its memory's owner (the memory id is the parameter), so a search
# reads one user's rows only.
_USER_OF = "(SELECT user_id FROM memories WHERE id = ?)"


class PgWrites:
    """Writes inside one open transaction (see rows.Writes for what each method does)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    @property
    def conn(self) -> asyncpg.Connection:
        """The transaction's connection, for SQL of the rooms beside the rows (import's)."""
        return self._conn

    async def _fetch(self, sql: str, *params: Any) -> list[asyncpg.Record]:
        return await self._conn.fetch(numbered(sql), *params)

    async def _fetchrow(self, sql: str, *params: Any) -> asyncpg.Record | None:
        return await self._conn.fetchrow(numbered(sql), *params)

    async def _fetchval(self, sql: str, *params: Any) -> Any:
        return await self._conn.fetchval(numbered(sql), *params)

    async def _execute(self, sql: str, *params: Any) -> None:
        await self._conn.execute(numbered(sql), *params)

    async def get(self, memory_id: str) -> MemoryRow | None:
        """The row as this transaction sees it."""
        found = await self._fetchrow(f"SELECT {_COLUMNS} FROM memories WHERE id = ?", memory_id)
        return _row(found) if found is not None else None

    async def owner_rows(
        self, user_id: str, agent_id: str, layer: str, label: str
    ) -> list[MemoryRow]:
        """Every row (live or retired) of one owner, layer and label, oldest first."""
        rows = await self._fetch(
            f"SELECT {_COLUMNS} FROM memories WHERE user_id = ? AND agent_id = ? AND layer = ? "
            "AND label = ? ORDER BY created_at, seq",
            user_id, agent_id, layer, label,
        )
        return [_row(r) for r in rows]

    async def forget_marks(self, user_id: str, agent_id: str) -> list[MemoryRow]:
        """The rows of one owner that may record a forgotten value: rows retired as forgotten,
        and raw turns whose metadata names tombstones."""
        rows = await self._fetch(FORGET_MARKS, user_id, agent_id, FORGET_MARKS_LIKE)
        return [_row(r) for r in rows]

    async def rows_off_calendar(self, start: float, end: float) -> list[MemoryRow]:
        """Every row with a date (event_at, valid_to, due_at) outside [start, end)."""
        return [_row(r) for r in await self._fetch(OFF_CALENDAR, *(start, end) * len(DATES))]

    async def edges_off_calendar(self, start: float, end: float) -> list[Edge]:
        """Every edge with a date (valid_from, valid_to) outside [start, end)."""
        found = await self._fetch(EDGES_OFF_CALENDAR, *(start, end) * len(EDGE_DATES))
        return [_edge(r) for r in found]

    async def vector(self, memory_id: str) -> np.ndarray:
        """A row's stored vector."""
        stored = await self._fetchval("SELECT vector FROM vectors WHERE memory_id = ?", memory_id)
        return np.asarray(stored.to_numpy(), dtype=np.float32)

    async def insert(self, row: MemoryRow, vector: np.ndarray) -> int:
        """Adds a row and its vector; returns the vector's key.

        An id already stored is refused as apply.py refuses it (it looks first, under the
        write lock, so this is only the last guard)."""
        try:
            await self._execute(
                f"INSERT INTO memories ({_COLUMNS}) VALUES ({','.join('?' * ROW_WIDTH)})",
                row.id, row.user_id, row.agent_id, row.session_id, row.layer, row.content,
                row.label, row.count, row.hits, json.dumps(list(row.source_ids)),
                row.metadata_json, row.model_id, row.created_at, row.updated_at, row.event_at,
                row.valid_to, row.due_at, row.status, row.invalid_at, row.superseded_by,
                row.superseded_how, row.drop_reason, row.retired_by, row.pass_id,
                row.extraction_status, row.extraction_tries, row.write_mode,
                row.utc_offset_minutes,
            )
        except asyncpg.UniqueViolationError as exc:
            raise Conflict(f"memory {row.id!r} already exists") from exc
        return await self._put_vector(row.id, row.model_id, vector)

    async def _put_vector(self, memory_id: str, model_id: str, vector: np.ndarray) -> int:
        key = await self._fetchval(
            "INSERT INTO vectors (memory_id, model_id, vector, user_id) "
            f"VALUES (?, ?, ?, {_USER_OF}) RETURNING key",
            memory_id, model_id, vector, memory_id,
        )
        return int(key)

    async def update(self, memory_id: str, fields: dict[str, Any]) -> None:
        """Sets the given columns of one row."""
        unknown = set(fields) - UPDATABLE_COLUMNS
        if unknown:
            raise ValueError(f"not updatable: {sorted(unknown)}")
        if not fields:
            return
        assignments = ", ".join(f"{name} = ?" for name in fields)
        await self._execute(
            f"UPDATE memories SET {assignments} WHERE id = ?", *fields.values(), memory_id
        )

    async def replace_vector(
        self, memory_id: str, model_id: str, vector: np.ndarray
    ) -> tuple[int | None, int]:
        """Gives a row a new vector under a new key; returns (old key, new key)."""
        old = await self._fetchval(
            "DELETE FROM vectors WHERE memory_id = ? RETURNING key", memory_id
        )
        return old, await self._put_vector(memory_id, model_id, vector)

    async def vector_key(self, memory_id: str) -> int | None:
        """The key of a row's vector, if it has one."""
        key = await self._fetchval("SELECT key FROM vectors WHERE memory_id = ?", memory_id)
        return int(key) if key is not None else None

    async def delete(self, memory_id: str) -> int | None:
        """Erases a row (its vector and keys go with it: ON DELETE CASCADE); returns the
        vector's key."""
        key = await self.vector_key(memory_id)
        await self._execute("DELETE FROM memories WHERE id = ?", memory_id)
        return key

    async def vector_keys(self, memory_id: str) -> list[int]:
        """The index keys of every extra vector key of a row (clauses, facts)."""
        rows = await self._fetch(
            "SELECT key FROM memory_keys WHERE memory_id = ? AND vector IS NOT NULL", memory_id
        )
        return [CLAUSE_KEY_OFFSET + r[0] for r in rows]

    async def drop_vector_keys(
        self, memory_id: str, kind: str, text: str | None = None
    ) -> list[int]:
        """Removes a row's extra vector keys of one kind (with that text, when given); returns
        their index keys."""
        rows = await self._fetch(
            f"DELETE FROM memory_keys WHERE {VECTOR_KEYS_OF} RETURNING key",
            memory_id, kind, text,
        )
        return [CLAUSE_KEY_OFFSET + r[0] for r in rows]

    async def add_clause_key(
        self, memory_id: str, kind: str, text: str, model_id: str, vector: np.ndarray
    ) -> int:
        """Adds one vector key pointing at a row; returns its index key."""
        key = await self._fetchval(
            "INSERT INTO memory_keys (memory_id, kind, text, model_id, vector, user_id) "
            f"VALUES (?, ?, ?, ?, ?, {_USER_OF}) RETURNING key",
            memory_id, kind, text, model_id, vector, memory_id,
        )
        return CLAUSE_KEY_OFFSET + int(key)

    async def previous_turn(self, row: MemoryRow, since: float) -> tuple[str, str] | None:
        """The id and text of the owner's write before row in the same session and layer.

        Only a write made at or after since counts: an older one belongs to another sitting.
        """
        found = await self._fetchrow(
            "SELECT id, content FROM memories WHERE user_id = ? AND agent_id = ? "
            "AND session_id = ? AND layer = ? AND id != ? AND created_at >= ? "
            "ORDER BY seq DESC LIMIT 1",
            row.user_id, row.agent_id, row.session_id, row.layer, row.id, since,
        )
        return (found[0], found[1]) if found is not None else None

    async def context_key(self, memory_id: str) -> str | None:
        """The text of a row's context key, if it has one."""
        text = await self._fetchval(
            "SELECT text FROM memory_keys WHERE memory_id = ? AND kind = 'context'", memory_id
        )
        return str(text) if text is not None else None

    async def set_context_key(self, memory_id: str, text: str) -> None:
        """Gives a row its context key text (keyword only), replacing any it had."""
        updated = await self._fetchval(
            "UPDATE memory_keys SET text = ? WHERE memory_id = ? AND kind = 'context' "
            "RETURNING key",
            text, memory_id,
        )
        if updated is None:
            await self._execute(
                "INSERT INTO memory_keys (memory_id, kind, text, user_id) "
                f"VALUES (?, 'context', ?, {_USER_OF})",
                memory_id, text, memory_id,
            )

    async def rows_in(self, reach: Reach, layers: Sequence[str]) -> list[MemoryRow]:
        """Every row (live or retired) inside a reach and layers."""
        where, params = _filters(reach, layers)
        rows = await self._fetch(
            f"SELECT {_M_COLUMNS} FROM memories m {_where(where)} ORDER BY m.seq", *params
        )
        return [_row(r) for r in rows]

    async def derived_from(
        self, memory_id: str, layers: Sequence[str] = DERIVED_LAYERS
    ) -> list[MemoryRow]:
        """Rows of the layers (the derived ones, L4, L5, L6, unless told) that list memory_id
        among their evidence."""
        # Containment (@>), not jsonb's `?` operator: numbered() takes every `?` for a parameter.
        rows = await self._fetch(
            rows_of_layers(layers) + "source_ids::jsonb @> jsonb_build_array(?::text)",
            memory_id,
        )
        return [_row(r) for r in rows]

    async def pages_citing(self, memory_id: str) -> list[MemoryRow]:
        """Entity pages (L8) whose metadata names memory_id (a line cites it as a fact)."""
        rows = await self._fetch(
            f"SELECT {_COLUMNS} FROM memories WHERE layer = 'l8_entity' "
            "AND strpos(metadata, ?) > 0",
            json.dumps(memory_id),
        )
        return [_row(r) for r in rows]

    async def live_edge(
        self, user_id: str, agent_id: str, key: tuple[str, str, str]
    ) -> Edge | None:
        """The owner's live edge whose names have this key (shared.text.edge_key), if any."""
        found = await self._fetchrow(LIVE_EDGE, user_id, agent_id, *key)
        return _edge(found) if found is not None else None

    async def get_edge(self, edge_id: str) -> Edge | None:
        """One edge by id."""
        found = await self._fetchrow(
            f"SELECT {_EDGE_COLUMNS} FROM graph_edges WHERE id = ?", edge_id
        )
        return _edge(found) if found is not None else None

    async def insert_edge(self, edge: Edge) -> None:
        """Adds an edge; an id already stored is refused, as insert refuses a row's."""
        try:
            await self._execute(ADD_EDGE, *edge_values(edge))
        except asyncpg.UniqueViolationError as exc:
            raise Conflict(f"edge {edge.id!r} already exists") from exc

    async def update_edge(self, edge_id: str, **fields: Any) -> None:
        """Sets columns of one edge (lists are stored as JSON)."""
        values = {
            name: json.dumps(list(value)) if isinstance(value, tuple | list) else value
            for name, value in fields.items()
        }
        assignments = ", ".join(f"{name} = ?" for name in values)
        await self._execute(
            f"UPDATE graph_edges SET {assignments} WHERE id = ?", *values.values(), edge_id
        )

    async def edges_of_memories(self, memory_ids: Sequence[str]) -> list[Edge]:
        """The edges whose searchable memory is one of memory_ids."""
        rows = await self._fetch(
            f"SELECT {_EDGE_COLUMNS} FROM graph_edges WHERE memory_id = ANY(?::text[])",
            list(memory_ids),
        )
        return [_edge(r) for r in rows]

    async def rowless_edges_on(self, fact_ids: Sequence[str]) -> list[Edge]:
        """The edges with no L5 row that list one of fact_ids among their facts."""
        rows = await self._fetch(
            f"SELECT {_EDGE_COLUMNS} FROM graph_edges WHERE memory_id = '' AND EXISTS "
            "(SELECT 1 FROM jsonb_array_elements_text(fact_ids::jsonb) AS fact(id) "
            "WHERE fact.id = ANY(?::text[]))",
            list(fact_ids),
        )
        return [_edge(r) for r in rows]

    async def set_state(
        self, key: str, value: str, at: float, if_value: str | None = None
    ) -> None:
        """Sets one state value; an empty value removes it. With if_value, only while the key
        holds exactly that value (else nothing changes)."""
        if if_value is not None:
            sql, params = conditional_state(key, value, at, if_value)
            await self._execute(sql, *params)
            return
        if not value:
            await self._execute("DELETE FROM service_state WHERE key = ?", key)
            return
        await self._execute(
            "INSERT INTO service_state (key, value, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value, "
            "updated_at = excluded.updated_at",
            key, value, at,
        )

    async def record_pass_change(
        self, pass_id: str, kind: str, target_id: str, before: str = ""
    ) -> None:
        """Remembers one change of a consolidation pass for its undo."""
        await self._execute(
            "INSERT INTO pass_changes (pass_id, kind, target_id, before_json) VALUES (?, ?, ?, ?)",
            pass_id, kind, target_id, before,
        )

    async def idempotent_write(
        self, user_id: str, agent_id: str, key: str, since: float
    ) -> tuple[str, list[str]] | None:
        """The request hash and row ids a write recorded under a key since a time, if any."""
        found = await self._fetchrow(
            "SELECT request_hash, memory_ids FROM idempotency_keys "
            "WHERE user_id = ? AND agent_id = ? AND key = ? AND created_at >= ?",
            user_id, agent_id, key, since,
        )
        return (found[0], json.loads(found[1])) if found is not None else None

    async def record_idempotent_write(
        self, user_id: str, agent_id: str, key: str, request_hash: str, ids: Sequence[str],
        at: float,
    ) -> None:
        """Remembers the row ids a write gave under its key."""
        await self._execute(
            "INSERT INTO idempotency_keys "
            "(user_id, agent_id, key, request_hash, memory_ids, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (user_id, agent_id, key) DO UPDATE SET "
            "request_hash = excluded.request_hash, memory_ids = excluded.memory_ids, "
            "created_at = excluded.created_at",
            user_id, agent_id, key, request_hash, json.dumps(list(ids)), at,
        )

    async def forget_idempotent_writes(self, before: float) -> None:
        """Drops the keys recorded before a time."""
        await self._execute("DELETE FROM idempotency_keys WHERE created_at < ?", before)

    async def pass_changes(self, pass_id: str) -> list[tuple[str, str, str]]:
        """A pass's changes, newest first: (kind, target id, before)."""
        rows = await self._fetch(
            "SELECT kind, target_id, before_json FROM pass_changes WHERE pass_id = ? "
            "ORDER BY seq DESC",
            pass_id,
        )
        return [(r[0], r[1], r[2]) for r in rows]

    async def audit(
        self,
        *,
        actor: str,
        action: str,
        row: MemoryRow,
        before: MemoryRow | None,
        after: MemoryRow | None,
        reason: str,
        at: float,
    ) -> None:
        """Records one mutation with the row's owner, so history outlives a delete."""
        await self._execute(
            ADD_AUDIT,
            at, actor, action, row.id, row.user_id, row.agent_id,
            row_json(before), row_json(after), reason,
        )

    async def last_before(self, memory_id: str) -> str:
        """The row as its latest audit entry found it (JSON; "" when none says)."""
        rows = await self._fetch(LAST_BEFORE, memory_id)
        return next((str(r[0]) for r in rows if r[0]), "")

    async def restores_of(self, user_id: str) -> list[tuple[str, str]]:
        """Each restore of the user's rows: the row's id and the row as it found it (JSON)."""
        rows = await self._fetch(RESTORES_OF, user_id)
        return [(str(memory_id), str(before)) for memory_id, before in rows]

    async def scrub_history(self, memory_id: str) -> None:
        """Rewrites a row's audit entries as ids, owner, times and states only: its text,
        metadata and every reason but the delete's own are gone (see repo.ERASE_KEEPS)."""
        rows = await self._fetch(
            "SELECT seq, action, before_json, after_json, reason FROM audit WHERE memory_id = ?",
            memory_id,
        )
        await self._conn.executemany(
            numbered("UPDATE audit SET before_json = ?, after_json = ?, reason = ? WHERE seq = ?"),
            [
                (_erased(before), _erased(after), reason if action == "delete" else "", seq)
                for seq, action, before, after, reason in rows
            ],
        )

    async def turns_beside(self, row: MemoryRow) -> tuple[MemoryRow | None, MemoryRow | None]:
        """The owner's rows just before and just after row in its session and layer."""
        found: list[MemoryRow | None] = []
        for compare, order in (("<", "DESC"), (">", "ASC")):
            beside = await self._fetchrow(
                f"SELECT {_COLUMNS} FROM memories WHERE user_id = ? AND agent_id = ? "
                "AND session_id = ? AND layer = ? "
                f"AND seq {compare} (SELECT seq FROM memories WHERE id = ?) "
                f"ORDER BY seq {order} LIMIT 1",
                row.user_id, row.agent_id, row.session_id, row.layer, row.id,
            )
            found.append(_row(beside) if beside is not None else None)
        return found[0], found[1]

    async def merge_keyword_indexes(self) -> None:
        """Nothing: PostgreSQL's keyword index has no segments to merge. A deleted text's
        tuples (heap, TOAST and GIN entries) stay in the files until VACUUM reclaims them,
        which cannot run inside a transaction; PgRepo.purge_erased runs it after the commit."""
