"""SQLite storage of rows, vectors, the keyword index and the audit log (aiosqlite, WAL)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import aiosqlite
import numpy as np

from services.store import fulltext
from services.store.disk_full import disk_full
from services.store.keys import CLAUSE
from services.store.model import (
    ACTIVE,
    DERIVED_LAYERS,
    FORGOTTEN,
    RAW,
    RETIRED,
    AuditEntry,
    CountQuery,
    Edge,
    ListPage,
    ListQuery,
    MemoryRow,
    Reach,
)
from services.store.off_calendar import DATES, EDGE_DATES
from services.store.schema import create_or_migrate
from services.store.text_index import (
    KEYWORDS_FOLDER,
    LOG_HIGH,
    SOURCES,
    KeywordIndex,
    high_of,
)
from shared.layers import EXTRACTION_TRIES, UNEXTRACTED
from shared.runtime import trim_heap
from shared.text import edge_key
from shared.tombstones import TOMBSTONES_KEY

# One audit entry, whoever writes it (a mutation, or an import of history from elsewhere).
ADD_AUDIT = (
    "INSERT INTO audit (at, actor, action, memory_id, user_id, agent_id, before_json, "
    "after_json, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)

# What a row's latest audit entry found it as.
LAST_BEFORE = "SELECT before_json FROM audit WHERE memory_id = ? ORDER BY seq DESC LIMIT 1"
RESTORES_OF = (
    "SELECT memory_id, before_json FROM audit WHERE action = 'restore' AND user_id = ? "
    "ORDER BY seq"
)

_EDGE_COLUMNS = (
    "id, user_id, agent_id, subject, relation, object, weight, source_ids, fact_ids, memory_id, "
    "recorded_at, invalidated_at, valid_from, valid_to, stale, pass_id"
)


def _off_calendar(columns: str, table: str, dates: Sequence[str]) -> str:
    """The rows of a table with one of dates outside [start, end): the bounds are the
    parameters, twice per date."""
    return f"SELECT {columns} FROM {table} WHERE " + " OR ".join(
        f"NOT ({name} >= ? AND {name} < ?)" for name in dates
    )


EDGES_OFF_CALENDAR = _off_calendar(_EDGE_COLUMNS, "graph_edges", EDGE_DATES)
# An edge's names are compared by their keys (shared.text.edge_key), stored beside them: SQL's
# lower() is not the same on the two backends.
ADD_EDGE = (
    f"INSERT INTO graph_edges ({_EDGE_COLUMNS}, subject_key, relation_key, object_key) "
    f"VALUES ({','.join('?' * 19)})"
)
# Not a stale edge: it keeps the row and evidence it had when they went, so a restore of them
# brings it back as it was; a triple learnt again meanwhile gets an edge of its own.
LIVE_EDGE = (
    f"SELECT {_EDGE_COLUMNS} FROM graph_edges WHERE user_id = ? AND agent_id = ? "
    "AND subject_key = ? AND relation_key = ? AND object_key = ? "
    "AND undone = 0 AND stale = 0 AND invalidated_at IS NULL ORDER BY seq DESC LIMIT 1"
)


def conditional_state(
    key: str, value: str, at: float, if_value: str
) -> tuple[str, tuple[Any, ...]]:
    """The SQL and its parameters that set a state value (an empty one: remove it) only while
    the key holds exactly if_value, on either backend."""
    if not value:
        return "DELETE FROM service_state WHERE key = ? AND value = ?", (key, if_value)
    return (
        "UPDATE service_state SET value = ?, updated_at = ? WHERE key = ? AND value = ?",
        (value, at, key, if_value),
    )


# A key carries its memory's owner key, for the keyword index (the memory id is the parameter).
_OWNER_KEY_OF = "(SELECT owner_key FROM memories WHERE id = ?)"

# Vector keys of clause rows live in the same usearch index as memories' own vectors; they are
# told apart by this offset (the vectors table's keys stay far below it).
CLAUSE_KEY_OFFSET = 1 << 40

log = logging.getLogger(__name__)

# A read of this many rows by key or fewer runs on the event loop, on a connection of its own:
# it takes tens of microseconds (a search's four reads about 0.11 ms of SQLite in all), less than
# the hand-off to a connection's thread and back. A store vector search at 100,000 memories, its
# reads and its index search on the loop: 3.24-3.52 ms p50 -> 2.84-3.15.
QUICK_READ_KEYS = 256


def split_keys(keys: Sequence[int]) -> tuple[list[int], list[int]]:
    """Vector keys as the vectors table's keys (a row's own) and the memory_keys table's
    (its extra keys, the offset taken off)."""
    own = [int(k) for k in keys if k < CLAUSE_KEY_OFFSET]
    extra = [int(k) - CLAUSE_KEY_OFFSET for k in keys if k >= CLAUSE_KEY_OFFSET]
    return own, extra


# The memory of each vector key, and for a sentence key its text (parameters: own keys as JSON,
# CLAUSE_KEY_OFFSET, the sentence kind, extra keys as JSON). Driven by the keys (CROSS JOIN fixes
# the order): own keys through an index of (key, memory_id), as their rows are large; an extra
# key's row is read for its text (one read, where a search read the index and then the row).
MEMORIES_OF_KEYS = (
    "SELECT v.key, v.memory_id, '' FROM json_each(?) AS j "
    "CROSS JOIN vectors v INDEXED BY vectors_key_memory ON v.key = j.value UNION ALL "
    "SELECT ? + mk.key, mk.memory_id, CASE WHEN mk.kind = ? THEN mk.text ELSE '' END "
    "FROM json_each(?) AS j CROSS JOIN memory_keys mk ON mk.key = j.value"
)

# How many vectors each model made: read from the (model_id) index, not the rows, so a store
# opens without reading every vector (the table is 82 MB at 100,000 memories; counting from it
# with the page cache dropped read 870 MB from disk, the index 5.7 MB).
VECTOR_MODELS = "SELECT model_id, count(*) FROM vectors INDEXED BY vectors_model GROUP BY model_id"

# A row's extra vector keys of one kind, and of one text unless that is NULL (parameters:
# memory id, kind, text).
VECTOR_KEYS_OF = "memory_id = ? AND kind = ? AND vector IS NOT NULL AND text = COALESCE(?, text)"

_COLUMNS = (
    "id, user_id, agent_id, session_id, layer, content, label, count, hits, source_ids, "
    "metadata, model_id, created_at, updated_at, event_at, valid_to, due_at, status, "
    "invalid_at, superseded_by, superseded_how, drop_reason, retired_by, pass_id, "
    "extraction_status, extraction_tries, write_mode, utc_offset_minutes"
)
ROW_WIDTH = len(_COLUMNS.split(","))
"""How many values a row read with _COLUMNS takes; what a query selects after them follows."""
OFF_CALENDAR = _off_calendar(_COLUMNS, "memories", DATES)
_M_COLUMNS = ", ".join(f"m.{name.strip()}" for name in _COLUMNS.split(","))
FORGET_MARKS = (
    f"SELECT {_COLUMNS} FROM memories WHERE user_id = ? AND agent_id = ? AND "
    f"(superseded_how = '{FORGOTTEN}' OR (layer = '{RAW}' AND metadata LIKE ?))"
)
"""An owner's rows retired as forgotten, and its turns whose metadata may hold tombstones (the
parameter: FORGET_MARKS_LIKE); the caller reads the tombstones themselves."""
FORGET_MARKS_LIKE = f"%{json.dumps(TOMBSTONES_KEY)}%"
# The rows of the derived layers, to which a condition on their source_ids is added.
def rows_of_layers(layers: Sequence[str]) -> str:
    """The start of a query of rows in the given layers (its WHERE goes on after "AND")."""
    return (
        f"SELECT {_COLUMNS} FROM memories WHERE layer IN ("
        + ", ".join(f"'{layer}'" for layer in layers) + ") AND "
    )
UPDATABLE_COLUMNS = frozenset(
    {
        "content", "label", "count", "hits", "metadata", "model_id", "updated_at", "event_at",
        "valid_to", "due_at", "status", "invalid_at", "superseded_by", "superseded_how",
        "drop_reason", "retired_by", "pass_id", "extraction_status", "extraction_tries",
        "utc_offset_minutes",
    }
)


def list_page(rows: Sequence[Sequence[Any]], total: int) -> ListPage:
    """A list's rows (each ending with its seq) as a page, with the last row's place."""
    page = [_row(r) for r in rows]
    last = (page[-1].created_at, int(rows[-1][-1])) if rows else None
    return ListPage(page, int(total), last)


def _row(r: Sequence[Any]) -> MemoryRow:
    """A row read with _COLUMNS (and maybe more after them) as a MemoryRow."""
    sources = r[9]
    return MemoryRow.of_values(
        (*r[:9], () if sources == "[]" else tuple(json.loads(sources)), *r[10:ROW_WIDTH])
    )


def _edge(r: Sequence[Any]) -> Edge:
    return Edge(
        id=r[0],
        user_id=r[1],
        agent_id=r[2],
        subject=r[3],
        relation=r[4],
        object=r[5],
        weight=r[6],
        source_ids=tuple(json.loads(r[7])),
        fact_ids=tuple(json.loads(r[8])),
        memory_id=r[9],
        recorded_at=r[10],
        invalidated_at=r[11],
        valid_from=r[12],
        valid_to=r[13],
        stale=bool(r[14]),
        pass_id=r[15],
    )


def edge_values(edge: Edge) -> tuple[Any, ...]:
    """An edge's values for ADD_EDGE, its name keys last."""
    return (
        edge.id, edge.user_id, edge.agent_id, edge.subject, edge.relation, edge.object,
        edge.weight, json.dumps(list(edge.source_ids)), json.dumps(list(edge.fact_ids)),
        edge.memory_id, edge.recorded_at, edge.invalidated_at, edge.valid_from, edge.valid_to,
        int(edge.stale), edge.pass_id, *edge_key(edge.subject, edge.relation, edge.object),
    )


def _edge_filters(reach: Reach) -> tuple[list[str], list[Any]]:
    owned, params = reach.sql()
    return ["undone = 0", *owned], list(params)


# A stored vector is tagged. "q\0": a little-endian float32 scale, then one signed byte a
# component, the component being the byte times the scale (the largest component is 127 of
# them). "h\0": little-endian float16, as stores wrote before. An untagged blob (written before
# the tags) is little-endian float32. A float32 blob's length is a multiple of 4, a tagged one's
# never is.
_BYTES = b"q\x00"
_HALF = b"h\x00"
_SCALE = np.dtype("<f4")


def _quantized(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's float32 scale and its components as signed bytes of that scale."""
    rows = np.atleast_2d(np.asarray(vectors, dtype=np.float32))
    top = np.abs(rows).max(axis=1, initial=0.0)
    scales = np.where(top > 0, top / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    return scales, np.rint(rows / scales[:, None]).astype(np.int8)


def vector_blob(vector: np.ndarray) -> bytes:
    """How a vector is stored (see unblob): 8 bits a component and its own scale."""
    scales, values = _quantized(vector)
    return _BYTES + scales.astype(_SCALE).tobytes() + values.tobytes()


def as_stored(vectors: np.ndarray) -> np.ndarray:
    """Vectors as the database gives them back (float32 of their stored values): a vector
    index fed by writes holds what one built from the database would."""
    scales, values = _quantized(vectors)
    return values.astype(np.float32) * scales[:, None]


def unblob(blob: bytes) -> np.ndarray:
    """The float32 vector a stored blob holds."""
    if len(blob) % 4 == 2 and blob.startswith(_BYTES):
        scale = np.frombuffer(blob, dtype=_SCALE, count=1, offset=2)
        return np.frombuffer(blob, dtype=np.int8, offset=2 + _SCALE.itemsize).astype(
            np.float32) * scale[0]
    if len(blob) % 4 == 2 and blob.startswith(_HALF):
        return np.frombuffer(blob, dtype="<f2", offset=2).astype(np.float32)
    return np.frombuffer(blob, dtype="<f4")


def _filters(
    reach: Reach,
    layers: Iterable[str] = (),
    include_superseded: bool = True,
    exclude_layers: Iterable[str] = (),
) -> tuple[list[str], list[Any]]:
    """SQL conditions on alias `m` (the memories table) and their parameters."""
    where, owner_params = reach.sql("m.")
    params: list[Any] = list(owner_params)
    layers = list(layers)
    exclude = list(exclude_layers)
    if layers:
        where.append(f"m.layer IN ({','.join('?' * len(layers))})")
        params.extend(layers)
    elif exclude:
        where.append(f"m.layer NOT IN ({','.join('?' * len(exclude))})")
        params.extend(exclude)
    if not include_superseded:
        where.append("m.status = ?")
        params.append(ACTIVE)
    return where, params


def _where(conditions: list[str]) -> str:
    return ("WHERE " + " AND ".join(conditions)) if conditions else ""


class Tx:
    """Writes inside one open transaction of the writer connection.

    The statements each written row makes (a row, its vector, its keys, its audit entry, and
    reads by key) run on the event loop on the writer's own SQLite connection (`inline`): each
    takes a few microseconds, against 50-110 for the hand-off to the connection's thread and
    back, and a 500-line import makes about 3,500 of them while it holds the write lock. Inside
    the transaction the connection holds SQLite's write lock, so they never wait for one. Other
    statements (scans of an owner's rows, index merges) stay on the connection's thread.
    """

    def __init__(self, conn: aiosqlite.Connection, inline: sqlite3.Connection) -> None:
        self._conn = conn
        self._inline = inline

    async def get(self, memory_id: str) -> MemoryRow | None:
        """The row as this transaction sees it."""
        found = self._inline.execute(
            f"SELECT {_COLUMNS} FROM memories WHERE id = ?", (memory_id,)
        ).fetchone()
        return _row(found) if found is not None else None

    async def owner_rows(
        self, user_id: str, agent_id: str, layer: str, label: str
    ) -> list[MemoryRow]:
        """Every row (live or retired) of one owner, layer and label, oldest first."""
        rows = await self._conn.execute_fetchall(
            f"SELECT {_COLUMNS} FROM memories WHERE user_id = ? AND agent_id = ? AND layer = ? "
            "AND label = ? ORDER BY created_at, seq",
            (user_id, agent_id, layer, label),
        )
        return [_row(r) for r in rows]

    async def forget_marks(self, user_id: str, agent_id: str) -> list[MemoryRow]:
        """The rows of one owner that may record a forgotten value: rows retired as forgotten,
        and raw turns whose metadata names tombstones."""
        rows = await self._conn.execute_fetchall(
            FORGET_MARKS, (user_id, agent_id, FORGET_MARKS_LIKE)
        )
        return [_row(r) for r in rows]

    async def rows_off_calendar(self, start: float, end: float) -> list[MemoryRow]:
        """Every row with a date (event_at, valid_to, due_at) outside [start, end)."""
        rows = await self._conn.execute_fetchall(OFF_CALENDAR, (start, end) * len(DATES))
        return [_row(r) for r in rows]

    async def edges_off_calendar(self, start: float, end: float) -> list[Edge]:
        """Every edge with a date (valid_from, valid_to) outside [start, end)."""
        rows = await self._conn.execute_fetchall(
            EDGES_OFF_CALENDAR, (start, end) * len(EDGE_DATES)
        )
        return [_edge(r) for r in rows]

    async def vector(self, memory_id: str) -> np.ndarray:
        """A row's stored vector."""
        rows = await self._conn.execute_fetchall(
            "SELECT vector FROM vectors WHERE memory_id = ?", (memory_id,)
        )
        return unblob(next(iter(rows))[0])

    async def insert(self, row: MemoryRow, vector: np.ndarray) -> int:
        """Adds a row and its vector; returns the vector's key."""
        self._inline.execute(
            f"INSERT INTO memories ({_COLUMNS}) VALUES ({','.join('?' * ROW_WIDTH)})",
            (
                row.id, row.user_id, row.agent_id, row.session_id, row.layer, row.content,
                row.label, row.count, row.hits, json.dumps(list(row.source_ids)),
                row.metadata_json, row.model_id, row.created_at, row.updated_at, row.event_at,
                row.valid_to, row.due_at, row.status, row.invalid_at, row.superseded_by,
                row.superseded_how, row.drop_reason, row.retired_by, row.pass_id,
                row.extraction_status, row.extraction_tries, row.write_mode,
                row.utc_offset_minutes,
            ),
        )
        return await self._put_vector(row.id, row.model_id, vector)

    async def _put_vector(self, memory_id: str, model_id: str, vector: np.ndarray) -> int:
        cursor = self._inline.execute(
            "INSERT INTO vectors (memory_id, model_id, vector) VALUES (?, ?, ?)",
            (memory_id, model_id, vector_blob(vector)),
        )
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    async def update(self, memory_id: str, fields: dict[str, Any]) -> None:
        """Sets the given columns of one row."""
        unknown = set(fields) - UPDATABLE_COLUMNS
        if unknown:
            raise ValueError(f"not updatable: {sorted(unknown)}")
        if not fields:
            return
        assignments = ", ".join(f"{name} = ?" for name in fields)
        self._inline.execute(
            f"UPDATE memories SET {assignments} WHERE id = ?", (*fields.values(), memory_id)
        )

    async def replace_vector(
        self, memory_id: str, model_id: str, vector: np.ndarray
    ) -> tuple[int | None, int]:
        """Gives a row a new vector under a new key; returns (old key, new key)."""
        old = await self.vector_key(memory_id)
        await self._conn.execute("DELETE FROM vectors WHERE memory_id = ?", (memory_id,))
        return old, await self._put_vector(memory_id, model_id, vector)

    async def vector_key(self, memory_id: str) -> int | None:
        """The key of a row's vector, if it has one."""
        found = self._inline.execute(
            "SELECT key FROM vectors WHERE memory_id = ?", (memory_id,)
        ).fetchone()
        return found[0] if found is not None else None

    async def delete(self, memory_id: str) -> int | None:
        """Erases a row (its vector and keyword entry go with it); returns the vector's key."""
        key = await self.vector_key(memory_id)
        await self._conn.execute("DELETE FROM memories WHERE id = ?", (memory_id,))
        return key

    async def vector_keys(self, memory_id: str) -> list[int]:
        """The index keys of every extra vector key of a row (clauses, facts)."""
        rows = await self._conn.execute_fetchall(
            "SELECT key FROM memory_keys WHERE memory_id = ? AND vector IS NOT NULL",
            (memory_id,),
        )
        return [CLAUSE_KEY_OFFSET + r[0] for r in rows]

    async def drop_vector_keys(
        self, memory_id: str, kind: str, text: str | None = None
    ) -> list[int]:
        """Removes a row's extra vector keys of one kind (with that text, when given); returns
        their index keys."""
        rows = await self._conn.execute_fetchall(
            f"DELETE FROM memory_keys WHERE {VECTOR_KEYS_OF} RETURNING key",
            (memory_id, kind, text),
        )
        return [CLAUSE_KEY_OFFSET + r[0] for r in rows]

    async def add_clause_key(
        self, memory_id: str, kind: str, text: str, model_id: str, vector: np.ndarray
    ) -> int:
        """Adds one vector key pointing at a row; returns its index key."""
        cursor = self._inline.execute(
            "INSERT INTO memory_keys (memory_id, kind, text, model_id, vector, owner_key) "
            f"VALUES (?, ?, ?, ?, ?, {_OWNER_KEY_OF})",
            (memory_id, kind, text, model_id, vector_blob(vector), memory_id),
        )
        assert cursor.lastrowid is not None
        return CLAUSE_KEY_OFFSET + cursor.lastrowid

    async def previous_turn(self, row: MemoryRow, since: float) -> tuple[str, str] | None:
        """The id and text of the owner's write before row in the same session and layer.

        Only a write made at or after since counts: an older one belongs to another sitting.
        """
        found = self._inline.execute(
            "SELECT id, content FROM memories WHERE user_id = ? AND agent_id = ? "
            "AND session_id = ? AND layer = ? AND id != ? AND created_at >= ? "
            "ORDER BY seq DESC LIMIT 1",
            (row.user_id, row.agent_id, row.session_id, row.layer, row.id, since),
        ).fetchone()
        return (found[0], found[1]) if found is not None else None

    async def context_key(self, memory_id: str) -> str | None:
        """The text of a row's context key, if it has one."""
        found = self._inline.execute(
            "SELECT text FROM memory_keys WHERE memory_id = ? AND kind = 'context'",
            (memory_id,),
        ).fetchone()
        return found[0] if found is not None else None

    async def set_context_key(self, memory_id: str, text: str) -> None:
        """Gives a row its context key text (keyword only), replacing any it had."""
        cursor = self._inline.execute(
            "UPDATE memory_keys SET text = ? WHERE memory_id = ? AND kind = 'context'",
            (text, memory_id),
        )
        if cursor.rowcount == 0:
            self._inline.execute(
                "INSERT INTO memory_keys (memory_id, kind, text, owner_key) "
                f"VALUES (?, 'context', ?, {_OWNER_KEY_OF})",
                (memory_id, text, memory_id),
            )

    async def rows_in(self, reach: Reach, layers: Sequence[str]) -> list[MemoryRow]:
        """Every row (live or retired) inside a reach and layers."""
        where, params = _filters(reach, layers)
        rows = await self._conn.execute_fetchall(
            f"SELECT {_M_COLUMNS} FROM memories m {_where(where)} ORDER BY m.seq", params
        )
        return [_row(r) for r in rows]

    async def derived_from(
        self, memory_id: str, layers: Sequence[str] = DERIVED_LAYERS
    ) -> list[MemoryRow]:
        """Rows of the layers (the derived ones, L4, L5, L6, unless told) that list memory_id
        among their evidence."""
        rows = await self._conn.execute_fetchall(
            rows_of_layers(layers)
            + "EXISTS (SELECT 1 FROM json_each(memories.source_ids) WHERE value = ?)",
            (memory_id,),
        )
        return [_row(r) for r in rows]

    async def pages_citing(self, memory_id: str) -> list[MemoryRow]:
        """Entity pages (L8) whose metadata names memory_id (a line cites it as a fact)."""
        rows = await self._conn.execute_fetchall(
            f"SELECT {_COLUMNS} FROM memories WHERE layer = 'l8_entity' "
            "AND instr(metadata, ?) > 0",
            (json.dumps(memory_id),),
        )
        return [_row(r) for r in rows]

    async def live_edge(
        self, user_id: str, agent_id: str, key: tuple[str, str, str]
    ) -> Edge | None:
        """The owner's live edge whose names have this key (shared.text.edge_key), if any."""
        rows = await self._conn.execute_fetchall(LIVE_EDGE, (user_id, agent_id, *key))
        return _edge(next(iter(rows))) if rows else None

    async def get_edge(self, edge_id: str) -> Edge | None:
        """One edge by id."""
        rows = await self._conn.execute_fetchall(
            f"SELECT {_EDGE_COLUMNS} FROM graph_edges WHERE id = ?", (edge_id,)
        )
        return _edge(next(iter(rows))) if rows else None

    async def insert_edge(self, edge: Edge) -> None:
        """Adds an edge."""
        await self._conn.execute(ADD_EDGE, edge_values(edge))

    async def update_edge(self, edge_id: str, **fields: Any) -> None:
        """Sets columns of one edge (lists are stored as JSON)."""
        values = {
            name: json.dumps(list(value)) if isinstance(value, tuple | list) else value
            for name, value in fields.items()
        }
        assignments = ", ".join(f"{name} = ?" for name in values)
        await self._conn.execute(
            f"UPDATE graph_edges SET {assignments} WHERE id = ?", (*values.values(), edge_id)
        )

    async def edges_of_memories(self, memory_ids: Sequence[str]) -> list[Edge]:
        """The edges whose searchable memory is one of memory_ids."""
        rows = await self._conn.execute_fetchall(
            f"SELECT {_EDGE_COLUMNS} FROM graph_edges WHERE memory_id IN "
            "(SELECT value FROM json_each(?))",
            (json.dumps(list(memory_ids)),),
        )
        return [_edge(r) for r in rows]

    async def rowless_edges_on(self, fact_ids: Sequence[str]) -> list[Edge]:
        """The edges with no L5 row that list one of fact_ids among their facts."""
        rows = await self._conn.execute_fetchall(
            f"SELECT {_EDGE_COLUMNS} FROM graph_edges WHERE memory_id = '' AND EXISTS "
            "(SELECT 1 FROM json_each(graph_edges.fact_ids) WHERE value IN "
            "(SELECT value FROM json_each(?)))",
            (json.dumps(list(fact_ids)),),
        )
        return [_edge(r) for r in rows]

    async def set_state(
        self, key: str, value: str, at: float, if_value: str | None = None
    ) -> None:
        """Sets one state value; an empty value removes it. With if_value, only while the key
        holds exactly that value (else nothing changes)."""
        if if_value is not None:
            sql, params = conditional_state(key, value, at, if_value)
            await self._conn.execute(sql, params)
            return
        if not value:
            await self._conn.execute("DELETE FROM service_state WHERE key = ?", (key,))
            return
        await self._conn.execute(
            "INSERT INTO service_state (key, value, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value, "
            "updated_at = excluded.updated_at",
            (key, value, at),
        )

    async def record_pass_change(
        self, pass_id: str, kind: str, target_id: str, before: str = ""
    ) -> None:
        """Remembers one change of a consolidation pass for its undo."""
        await self._conn.execute(
            "INSERT INTO pass_changes (pass_id, kind, target_id, before_json) VALUES (?, ?, ?, ?)",
            (pass_id, kind, target_id, before),
        )

    async def idempotent_write(
        self, user_id: str, agent_id: str, key: str, since: float
    ) -> tuple[str, list[str]] | None:
        """The request hash and row ids a write recorded under a key since a time, if any."""
        found = self._inline.execute(
            "SELECT request_hash, memory_ids FROM idempotency_keys "
            "WHERE user_id = ? AND agent_id = ? AND key = ? AND created_at >= ?",
            (user_id, agent_id, key, since),
        ).fetchone()
        if found is None:
            return None
        request_hash, ids = found
        return request_hash, json.loads(ids)

    async def record_idempotent_write(
        self, user_id: str, agent_id: str, key: str, request_hash: str, ids: Sequence[str],
        at: float,
    ) -> None:
        """Remembers the row ids a write gave under its key."""
        self._inline.execute(
            "INSERT OR REPLACE INTO idempotency_keys "
            "(user_id, agent_id, key, request_hash, memory_ids, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (user_id, agent_id, key, request_hash, json.dumps(list(ids)), at),
        )

    async def forget_idempotent_writes(self, before: float) -> None:
        """Drops the keys recorded before a time."""
        await self._conn.execute("DELETE FROM idempotency_keys WHERE created_at < ?", (before,))

    async def pass_changes(self, pass_id: str) -> list[tuple[str, str, str]]:
        """A pass's changes, newest first: (kind, target id, before)."""
        rows = await self._conn.execute_fetchall(
            "SELECT kind, target_id, before_json FROM pass_changes WHERE pass_id = ? "
            "ORDER BY seq DESC",
            (pass_id,),
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
        self._inline.execute(
            ADD_AUDIT,
            (
                at, actor, action, row.id, row.user_id, row.agent_id,
                row_json(before), row_json(after), reason,
            ),
        )

    async def last_before(self, memory_id: str) -> str:
        """The row as its latest audit entry found it (JSON; "" when none says)."""
        rows = await self._conn.execute_fetchall(LAST_BEFORE, (memory_id,))
        return next((str(r[0]) for r in rows if r[0]), "")

    async def restores_of(self, user_id: str) -> list[tuple[str, str]]:
        """Each restore of the user's rows: the row's id and the row as it found it (JSON)."""
        rows = await self._conn.execute_fetchall(RESTORES_OF, (user_id,))
        return [(str(memory_id), str(before)) for memory_id, before in rows]

    async def scrub_history(self, memory_id: str) -> None:
        """Rewrites a row's audit entries as ids, owner, times and states only: its text,
        metadata and every reason but the delete's own are gone (see ERASE_KEEPS)."""
        rows = await self._conn.execute_fetchall(
            "SELECT seq, action, before_json, after_json, reason FROM audit WHERE memory_id = ?",
            (memory_id,),
        )
        for seq, action, before, after, reason in rows:
            await self._conn.execute(
                "UPDATE audit SET before_json = ?, after_json = ?, reason = ? WHERE seq = ?",
                (_erased(before), _erased(after), reason if action == "delete" else "", seq),
            )

    async def turns_beside(self, row: MemoryRow) -> tuple[MemoryRow | None, MemoryRow | None]:
        """The owner's rows just before and just after row in its session and layer."""
        found: list[MemoryRow | None] = []
        for compare, order in (("<", "DESC"), (">", "ASC")):
            rows = await self._conn.execute_fetchall(
                f"SELECT {_COLUMNS} FROM memories WHERE user_id = ? AND agent_id = ? "
                "AND session_id = ? AND layer = ? "
                f"AND seq {compare} (SELECT seq FROM memories WHERE id = ?) "
                f"ORDER BY seq {order} LIMIT 1",
                (row.user_id, row.agent_id, row.session_id, row.layer, row.id),
            )
            found.append(_row(next(iter(rows))) if rows else None)
        return found[0], found[1]

    async def merge_keyword_indexes(self) -> None:
        """Marks the keyword indexes for a rebuild, in this transaction: a deleted text's terms
        stay in their old segments till then. Repo.checkpoint starts the rebuild once the
        delete is committed, and a store that stopped before it ended rebuilds when it opens.
        The mark counts erases, so a rebuild clears only the erases it saw."""
        await self._conn.execute(
            "INSERT INTO store_meta (key, value) VALUES (?, '1') "
            "ON CONFLICT(key) DO UPDATE SET value = CAST(value AS INTEGER) + 1",
            (KEYWORDS_PURGE,),
        )


# A store_meta key: the keyword indexes still hold a deleted text's terms.
KEYWORDS_PURGE = "keywords_purge"
# Log rows the keyword indexes hold are deleted once this many have gathered.
PRUNE_EVERY = 1000
# How long the keyword indexes gather commits before applying them in the background: a
# tantivy commit costs about 9 ms (a segment, its files synced), more than a small write's own
# work.
FOLLOW_DELAY_S = 0.5
# Once no commit came for this long after the keyword indexes applied the last, they let their
# writers go and the heap is trimmed: a store held 23-26 MB more at rest after a burst of adds
# with its writers kept (they are kept while commits keep coming, see KeywordIndex._writer).
WRITERS_IDLE_S = 1.0

# What a deleted row's audit entries keep: who and what it was, never what it said.
ERASE_KEEPS = (
    "id", "user_id", "agent_id", "session_id", "layer", "status", "model_id", "created_at",
    "updated_at", "event_at", "valid_to", "due_at", "invalid_at", "superseded_by",
    "superseded_how", "retired_by", "pass_id", "extraction_status", "extraction_tries",
    "write_mode", "utc_offset_minutes", "source_ids", "count", "hits",
)


def holds_text(content: str | None, wanted: str) -> bool:
    """SQL `holds_text(content, wanted)`: whether the content's lower case holds `wanted`
    (lower-cased by the caller). Python's lower() knows every script, which SQLite's does not;
    the PostgreSQL store compares with the database's lower()."""
    return content is not None and wanted in content.lower()


def _quick_connection(db_path: Path) -> sqlite3.Connection:
    """The connection of keyed_read: read-only, and SQLite busy is an error at once (the event
    loop must not wait for a lock)."""
    conn = sqlite3.connect(db_path, isolation_level=None)
    conn.execute("PRAGMA query_only = ON")
    conn.execute("PRAGMA busy_timeout = 0")
    return conn


async def replacement_chains(
    rows: Sequence[MemoryRow],
    depth: int,
    replacing: Callable[[list[str]], Awaitable[Iterable[Sequence[Any]]]],
) -> dict[str, list[MemoryRow]]:
    """For each row's id, the rows it replaced (and they in turn replaced), newest first, up to
    depth steps back; `replacing` gives the rows (columns as _COLUMNS) superseded by any of a
    list of ids, newest retirement first. A forgotten version is left out (the chain goes on
    past it); a row of another user is not followed (an import may name any id in
    superseded_by: another user's old text must not show as this row's)."""
    chains: dict[str, list[MemoryRow]] = {}
    owner = {row.id: row.user_id for row in rows}
    frontier = {row.id: row.id for row in rows}
    for _ in range(depth):
        if not frontier:
            break
        following: dict[str, str] = {}
        for r in await replacing(list(frontier)):
            old = _row(r)
            root = frontier[old.superseded_by]
            if old.user_id != owner[root]:
                continue
            chain = chains.setdefault(root, [])
            if all(old.id != seen.id for seen in chain) and old.id != root:
                if old.superseded_how != FORGOTTEN:
                    chain.append(old)
                following[old.id] = root
        frontier = following
    return chains


def _erased(row_json: str) -> str:
    """An audit entry's row JSON with only the ERASE_KEEPS fields left."""
    if not row_json:
        return ""
    data = json.loads(whole_row_json(row_json))
    return json.dumps({name: data[name] for name in ERASE_KEEPS if name in data}, sort_keys=True)


def row_fields(row: MemoryRow) -> dict[str, Any]:
    """Every field of a row as plain JSON values (metadata as an object)."""
    data = {name: getattr(row, name) for name in row.__dataclass_fields__}
    data["source_ids"] = list(row.source_ids)
    data["metadata"] = json.loads(data.pop("metadata_json") or "{}")
    return data


# Every field a row may leave at its default, with that default as row_fields gives it.
_REQUIRED = {n for n, f in MemoryRow.__dataclass_fields__.items() if f.default is MISSING}
_ROW_DEFAULTS = {
    name: value
    for name, value in row_fields(MemoryRow("", "", "", "", "", "")).items()
    if name not in _REQUIRED
}


def row_json(row: MemoryRow | None) -> str:
    """A row as a JSON object ("" for none) without the fields it leaves at their defaults: the
    shape audit entries are stored in (whole_row_json gives the rest back)."""
    if row is None:
        return ""
    fields = row_fields(row)
    kept = {k: v for k, v in fields.items() if k not in _ROW_DEFAULTS or v != _ROW_DEFAULTS[k]}
    return json.dumps(kept, ensure_ascii=False, sort_keys=True)


def whole_row_json(row_json: str) -> str:
    """A stored audit entry's row with every field; an erased entry (no content) as it is."""
    if not row_json:
        return ""
    data = json.loads(row_json)
    if "content" not in data:
        return row_json
    return json.dumps({**_ROW_DEFAULTS, **data}, ensure_ascii=False, sort_keys=True)


def audit_entry(values: Sequence[Any]) -> AuditEntry:
    """An audit entry as read from its table (seq, at, actor, action, memory_id, before_json,
    after_json, reason), its rows whole."""
    seq, at, actor, action, memory_id, before, after, reason = values
    return AuditEntry(
        seq, at, actor, action, memory_id, whole_row_json(before), whole_row_json(after), reason
    )


class SharedReads:
    """The reads whose SQL is the same on SQLite and PostgreSQL (`?` parameters); each
    backend's repo says how a statement runs (_fetch)."""

    async def _fetch(self, sql: str, *params: Any) -> Sequence[Sequence[Any]]:
        raise NotImplementedError

    async def get_meta(self, key: str) -> str | None:
        """A value of the store_meta table."""
        rows = await self._fetch("SELECT value FROM store_meta WHERE key = ?", key)
        return str(rows[0][0]) if rows and rows[0][0] is not None else None

    async def get(self, memory_id: str) -> MemoryRow | None:
        """One row by id, whoever owns it (callers check the scope)."""
        rows = await self._fetch(f"SELECT {_COLUMNS} FROM memories WHERE id = ?", memory_id)
        return _row(rows[0]) if rows else None

    async def user_ids(self) -> list[str]:
        """Every user id that has rows."""
        rows = await self._fetch("SELECT DISTINCT user_id FROM memories")
        return [r[0] for r in rows]

    async def keys_in(
        self, reach: Reach, layers: Sequence[str], include_superseded: bool
    ) -> list[int]:
        """Every vector key of the rows inside reach and layers."""
        where, params = _filters(reach, layers, include_superseded)
        return [key for key, _ in await self._keys(where, params, with_ids=False)]

    async def keys_of(self, reach: Reach, memory_ids: Sequence[str]) -> list[tuple[int, str]]:
        """Every vector key of the given rows inside reach, each with its row's id."""
        where, params = _filters(reach)
        where.append(f"m.id IN ({','.join('?' * len(memory_ids))})")
        return await self._keys(where, [*params, *memory_ids], with_ids=True)

    async def _keys(
        self, where: list[str], params: list[Any], with_ids: bool
    ) -> list[tuple[int, str]]:
        """The vector keys (own, then extra) of the rows the conditions on `m` pick, each with
        its row's id (with_ids) or "" (an exact search may read every key of an owner)."""
        memory_id = "m.id" if with_ids else "''"
        rows = await self._fetch(
            f"SELECT v.key, {memory_id} FROM vectors v JOIN memories m ON m.id = v.memory_id "
            f"{_where(where)}",
            *params,
        )
        clause = await self._fetch(
            f"SELECT mk.key, {memory_id} FROM memory_keys mk "
            f"JOIN memories m ON m.id = mk.memory_id {_where([*where, 'mk.vector IS NOT NULL'])}",
            *params,
        )
        return [(int(k), m) for k, m in rows] + [(CLAUSE_KEY_OFFSET + int(k), m) for k, m in clause]

    async def counts(
        self, reach: Reach, unextracted_after: float | None = None
    ) -> tuple[dict[str, int], int, int, int]:
        """Live rows per layer, retired rows, live unextracted raw rows (written after
        unextracted_after, when given) and vectors in a reach."""
        where, params = _filters(reach)
        rows = await self._fetch(
            f"SELECT m.layer, m.status, count(*) FROM memories m {_where(where)} "
            "GROUP BY m.layer, m.status",
            *params,
        )
        live: dict[str, int] = {}
        retired = 0
        for layer, status, n in rows:
            if status == RETIRED:
                retired += n
            else:
                live[layer] = live.get(layer, 0) + n
        unextracted_where = [
            *where,
            "m.layer = 'l2_raw'",
            "m.status = 'active'",
            # What catch-up works through: unconfigured turns wait for a key (shared.layers).
            "m.extraction_status IN (" + ", ".join(f"'{s}'" for s in sorted(UNEXTRACTED)) + ")",
            f"m.extraction_tries < {EXTRACTION_TRIES}",  # given up on: catch-up passes it over
        ]
        after = [] if unextracted_after is None else [unextracted_after]
        if after:
            unextracted_where.append("m.created_at > ?")  # too old for catch-up to take
        ((unextracted,),) = await self._fetch(
            f"SELECT count(*) FROM memories m {_where(unextracted_where)}", *params, *after
        )
        ((vectors,),) = await self._fetch(
            f"SELECT count(*) FROM vectors v JOIN memories m ON m.id = v.memory_id "
            f"{_where(where)}",
            *params,
        )
        return live, retired, int(unextracted), int(vectors)

    async def list_edges(
        self, reach: Reach, as_of: float | None, include_stale: bool, limit: int, offset: int
    ) -> tuple[list[Edge], int]:
        """Edges in a reach, newest first: true now, or as the graph stood at as_of (learnt by
        then, and not ended by then: an edge learnt to end later, at its valid_to, holds till
        then, as its L5 row does in a search)."""
        where, params = _edge_filters(reach)
        if as_of is not None:
            where.append(
                "recorded_at <= ? AND (invalidated_at IS NULL OR invalidated_at > ? "
                "OR valid_to > ?)"
            )
            params.extend([as_of, as_of, as_of])
        elif not include_stale:
            where.append("(invalidated_at IS NULL OR valid_to > ?)")
            params.append(time.time())
        if not include_stale:
            # Its evidence is forgotten or erased now: hidden from the graph at any time.
            where.append("stale = 0")
        clause = _where(where)
        rows = await self._fetch(
            f"SELECT {_EDGE_COLUMNS} FROM graph_edges {clause} ORDER BY seq DESC LIMIT ? OFFSET ?",
            *params, limit, offset,
        )
        ((total,),) = await self._fetch(f"SELECT count(*) FROM graph_edges {clause}", *params)
        return [_edge(r) for r in rows], int(total)

    async def history(self, memory_id: str) -> list[tuple[AuditEntry, str, str]]:
        """The audit entries of one row, oldest first, each with the owner it was recorded under."""
        rows = await self._fetch(
            "SELECT seq, at, actor, action, memory_id, before_json, after_json, reason, "
            "user_id, agent_id FROM audit WHERE memory_id = ? ORDER BY seq",
            memory_id,
        )
        return [(audit_entry(r[:8]), r[8], r[9]) for r in rows]


class Repo(SharedReads):
    """The store's SQLite database: a writer connection, a reader connection, a reader for
    each keyword index, one for reads that must see one moment (read_snapshot), and one for
    short reads by key on the event loop (keyed_read)."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self._writer: aiosqlite.Connection | None = None
        self._inline: sqlite3.Connection | None = None
        """The writer's SQLite connection itself, for Tx's statements on the event loop."""
        self._reader: aiosqlite.Connection | None = None
        self._snapshots: aiosqlite.Connection | None = None
        self._snapshot_lock = asyncio.Lock()
        self._quick: sqlite3.Connection | None = None
        self._text_readers: dict[str, aiosqlite.Connection] = {}
        self._keywords: dict[str, KeywordIndex] = {}
        self._follower: asyncio.Task[None] | None = None
        self._unfollowed = asyncio.Event()
        """Set by each commit, cleared as the follower's round begins: whether a commit came
        after it began (the follower waits on it before letting the writers go)."""
        self._purger: asyncio.Task[None] | None = None
        self._builder: asyncio.Task[None] | None = None
        self._build_room: int | None = None
        self._keywords_behind: dict[str, str] = {}
        """Why each keyword index that misses acknowledged writes now does (a full disk)."""
        """The data disk's free bytes when a keyword index build was last refused for want of
        room (None: none was): the indexes not built are built once more are free."""
        self._pruned = 0

    async def __aenter__(self) -> Repo:
        try:
            return await self._open()
        except BaseException:
            await self.close()  # what was opened before the failure
            raise

    async def _open(self) -> Repo:
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = await self._connect(inline=True)
        await self._writer.execute("PRAGMA journal_mode = WAL")
        await create_or_migrate(self._writer, self.db_path)
        # Reads go to their own connection so they never see a half-done Apply.
        self._reader = await self._connect()
        await self._reader.execute("PRAGMA query_only = ON")
        self._snapshots = await self._connect()
        await self._snapshots.execute("PRAGMA query_only = ON")
        self._quick = _quick_connection(self.db_path)
        # Keyword searches read on connections (and threads) of their own, one per index: the
        # indexes of one search are read side by side, and beside vector searches.
        for name in fulltext.BY_NAME:
            self._text_readers[name] = await self._connect()
            await self._text_readers[name].execute("PRAGMA query_only = ON")
        purge = await self.get_meta(KEYWORDS_PURGE) is not None
        for name, source in SOURCES.items():
            index = KeywordIndex(self.db_path.parent / KEYWORDS_FOLDER / name, source)
            self._keywords[name] = index
            try:
                await index.open(self._text_readers[name], rebuild=purge)
            except Exception as exc:
                if not disk_full(exc):
                    raise
                self._build_refused(name, exc)
            await self.keyword_index(name)  # applies what is pending, if the disk has room
        if purge and self._build_room is None:
            await self.writer.execute("DELETE FROM store_meta WHERE key = ?", (KEYWORDS_PURGE,))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def answers(self) -> bool:
        """Always: the database is a file of this process's."""
        return True

    async def close(self) -> None:
        """Closes every connection; closing twice is harmless."""
        for task in (self._follower, self._purger, self._builder):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._follower = self._purger = self._builder = None
        for index in self._keywords.values():
            await index.close()
        self._keywords.clear()
        for conn in (*self._text_readers.values(), self._snapshots, self._reader, self._writer):
            if conn is not None:
                await conn.close()
        if self._quick is not None:
            self._quick.close()
        self._text_readers.clear()
        self._reader = self._snapshots = self._writer = self._quick = self._inline = None

    async def _connect(self, inline: bool = False) -> aiosqlite.Connection:
        """A connection with the store's settings; with inline, its SQLite connection is also
        kept as self._inline, usable from the event loop's thread as well as its own."""

        def connector() -> sqlite3.Connection:
            conn = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=not inline)
            conn.create_function("holds_text", 2, holds_text, deterministic=True)
            if inline:
                self._inline = conn
            return conn

        conn = await aiosqlite.Connection(connector, iter_chunk_size=64)
        try:
            # FULL: a commit is on disk before Apply answers, so kill -9 loses nothing
            # acknowledged.
            await conn.execute("PRAGMA synchronous = FULL")
            await conn.execute("PRAGMA foreign_keys = ON")
            await conn.execute("PRAGMA busy_timeout = 10000")
            # A deleted row's bytes are overwritten, not left in free space for anyone to read.
            await conn.execute("PRAGMA secure_delete = ON")
        except BaseException:
            # Its thread would keep the process alive after the error: a store that never exits.
            await conn.close()
            raise
        return conn

    @property
    def writer(self) -> aiosqlite.Connection:
        """The connection all writes go through."""
        if self._writer is None:
            raise RuntimeError("repo is closed")
        return self._writer

    def _writer_inline(self) -> sqlite3.Connection:
        if self._inline is None:
            raise RuntimeError("repo is closed")
        return self._inline

    def text_reader(self, index: str) -> aiosqlite.Connection:
        """The connection searches of a keyword index go through (committed data only)."""
        if index not in self._text_readers:
            raise RuntimeError("repo is closed")
        return self._text_readers[index]

    async def keyword_index(self, name: str) -> KeywordIndex:
        """A keyword index, once it holds every committed change; as it stands while the disk
        is too full to apply them (a search must not fail for a write the disk refused)."""
        index = self._keywords.get(name)
        if index is None:
            raise RuntimeError("repo is closed")
        if not index.built:
            # Said once a refused build (_build_refused), not at every search meanwhile.
            self._build_when_room()
            log.debug("keyword index %s is not built (the disk was full): searched as empty", name)
            self._keywords_behind[name] = "is not built: the disk was full"
            return index
        # Whether the index is behind is asked on the event loop: a thread hop a search.
        await self._follow_one(name, index, high_of(await self.keyed_read(1, LOG_HIGH, ())))
        return index

    async def _follow_one(self, name: str, index: KeywordIndex, high: int | None = None) -> None:
        """Has one keyword index apply the logged changes (up to high); on a full disk it goes
        on without them, noted once (keyword_problem) rather than at each search."""
        try:
            await index.follow(self.text_reader(name), high)
        except Exception as exc:
            if not disk_full(exc):
                raise
            if name not in self._keywords_behind:
                log.warning("keyword index %s misses the latest writes till the disk has room: "
                            "%s", name, exc)
            self._keywords_behind[name] = "misses the latest writes till the disk has room"
        else:
            if self._keywords_behind.pop(name, None) is not None:
                log.info("keyword index %s holds every acknowledged write again", name)

    @property
    def keyword_problem(self) -> str:
        """Why keyword searches miss acknowledged writes now ("" when they do not)."""
        return "; ".join(
            f"keyword index {name} {why}" for name, why in sorted(self._keywords_behind.items())
        )

    def _build_refused(self, name: str, exc: Exception) -> None:
        """Notes a keyword index build that failed (on a full disk, as a rule): it is tried
        again once the disk has more room than now, or when the store next opens."""
        self._build_room = shutil.disk_usage(self.db_path.parent).free
        log.warning(
            "keyword index %s could not be built (%s); its keyword searches find nothing till it "
            "is, once the disk has more than %d bytes free",
            name, exc, self._build_room, exc_info=not disk_full(exc),
        )

    def _build_when_room(self) -> None:
        """Builds the keyword indexes not built yet in the background, if the disk has more
        room than when their build was last refused (a build reads every row: it is not tried
        again on a disk no emptier)."""
        if self._build_room is None or (self._builder is not None and not self._builder.done()):
            return
        if shutil.disk_usage(self.db_path.parent).free > self._build_room:
            self._builder = asyncio.get_running_loop().create_task(self._build_unbuilt())

    async def _build_unbuilt(self) -> None:
        for name, index in self._keywords.items():
            if not index.built:
                try:
                    await index.rebuild(self.text_reader(name))
                except Exception as exc:
                    self._build_refused(name, exc)
                    return
        self._build_room = None

    def _follow_soon(self) -> None:
        """Has the keyword indexes apply a commit's changes in the background, so a search
        seldom waits for them, gathering the commits of FOLLOW_DELAY_S in one; commits made
        while they apply are gathered for the next round."""
        self._unfollowed.set()
        self._build_when_room()
        if self._follower is None or self._follower.done():
            self._follower = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        try:
            while self._unfollowed.is_set():
                await asyncio.sleep(FOLLOW_DELAY_S)
                self._unfollowed.clear()
                for name, index in self._keywords.items():
                    if index.built:
                        await self._follow_one(name, index)
                await self._let_writers_go_when_idle()
        except Exception:  # a search applies the changes then, or reports the failure
            log.exception("keyword indexes could not follow the change log")

    async def _let_writers_go_when_idle(self) -> None:
        """Waits up to WRITERS_IDLE_S for another commit; if none came, the keyword indexes let
        their writers go and the freed pages go back to the system."""
        try:
            await asyncio.wait_for(self._unfollowed.wait(), WRITERS_IDLE_S)
        except TimeoutError:
            for index in self._keywords.values():
                await index.let_go()
            await asyncio.to_thread(trim_heap)

    async def _prune_text_changes(self) -> None:
        """Deletes the log rows no keyword index needs any more (inside a write's
        transaction)."""
        held = min((index.log_needed_after for index in self._keywords.values()), default=0)
        if held - self._pruned >= PRUNE_EVERY:
            await self.writer.execute("DELETE FROM text_changes WHERE seq <= ?", (held,))
            self._pruned = held

    @property
    def reader(self) -> aiosqlite.Connection:
        """The connection reads go through (it sees committed data only)."""
        if self._reader is None:
            raise RuntimeError("repo is closed")
        return self._reader

    async def _fetch(self, sql: str, *params: Any) -> Sequence[Sequence[Any]]:
        return list(await self.reader.execute_fetchall(sql, params))

    @contextlib.asynccontextmanager
    async def read_snapshot(self) -> AsyncIterator[aiosqlite.Connection]:
        """A connection for reads that must agree: inside one read transaction, they all see
        the rows committed when the first of them ran (WAL: writes go on meanwhile). One
        holder at a time; the shared reader would put other requests' reads in the past."""
        async with self._snapshot_lock:
            if self._snapshots is None:
                raise RuntimeError("repo is closed")
            conn = self._snapshots
            try:
                await conn.execute("BEGIN")
                yield conn
            finally:
                # aiosqlite runs statements in order, so this comes after any still queued (a
                # BEGIN whose caller was cancelled included): no transaction stays open.
                try:
                    await conn.execute("ROLLBACK")
                except sqlite3.OperationalError:
                    if conn.in_transaction:
                        raise

    async def keyed_read(
        self,
        keys: int,
        sql: str,
        params: Sequence[Any],
        conn: aiosqlite.Connection | None = None,
    ) -> Iterable[Sequence[Any]]:
        """The rows of a read by `keys` keys: at most QUICK_READ_KEYS on the event loop (unless
        SQLite is busy or locked: it never waits there), more on conn (the reader by default)."""
        if self._quick is not None and keys <= QUICK_READ_KEYS:
            try:
                return self._quick.execute(sql, params).fetchall()
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode not in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                    raise
        return await (conn or self.reader).execute_fetchall(sql, params)

    async def checkpoint(self) -> None:
        """Copies the write-ahead log into the database and truncates it (as far as readers
        allow: a page a reader still needs stays until the next checkpoint), has the keyword
        indexes apply every pending change, and after an erase starts their rebuild in the
        background."""
        await self.writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        for name in self._keywords:
            await self.keyword_index(name)
        if await self.get_meta(KEYWORDS_PURGE) is not None and (
            self._purger is None or self._purger.done()
        ):
            self._purger = asyncio.get_running_loop().create_task(self._purge())

    async def _purge(self) -> None:
        """Rebuilds the keyword indexes behind searches and writes (the erased rows are out of
        them already), then clears the erases it saw."""
        try:
            while (mark := await self.get_meta(KEYWORDS_PURGE)) is not None:
                for name, index in self._keywords.items():
                    await index.rebuild(self.text_reader(name))
                # Inside a write's transaction if one is open: rolled back with it, the mark
                # only brings another rebuild.
                await self.writer.execute(
                    "DELETE FROM store_meta WHERE key = ? AND value = ?", (KEYWORDS_PURGE, mark)
                )
        except Exception:  # the mark stays: the next erase or open rebuilds
            log.exception("rebuilding the keyword indexes after an erase failed")

    async def purge_erased(self) -> None:
        """Nothing: secure_delete overwrote an erased text in the database file, and the
        checkpoint under the write lock took it out of the write-ahead log (it must not fall
        inside another write's transaction)."""

    @contextlib.asynccontextmanager
    async def transaction(
        self, committed: Callable[[], Awaitable[None]] | None = None
    ) -> AsyncIterator[Tx]:
        """One write transaction: committed if the block succeeds, then `committed` runs;
        rolled back otherwise. A caller cancelled at any point (a deadline) leaves no
        transaction open, and one cancelled once the commit began still gets `committed`."""
        try:
            await self.writer.execute("BEGIN IMMEDIATE")
            await self._prune_text_changes()
            yield Tx(self.writer, self._writer_inline())
        except BaseException:
            await self._rollback()
            raise
        await asyncio.shield(self._commit(committed))

    async def _commit(self, committed: Callable[[], Awaitable[None]] | None) -> None:
        try:
            await self.writer.execute("COMMIT")
        except BaseException:
            await self._rollback()
            raise
        self._follow_soon()
        if committed is not None:
            await committed()

    async def _rollback(self) -> None:
        # aiosqlite runs statements in order on one thread, so this comes after any statement
        # still running there: a BEGIN its caller stopped waiting for is rolled back too.
        try:
            await self.writer.execute("ROLLBACK")
        except sqlite3.OperationalError:
            if self.writer.in_transaction:
                raise
            # Nothing was open: the BEGIN itself failed.

    async def set_meta(self, key: str, value: str) -> None:
        """Sets a value of the store_meta table."""
        await self.writer.execute(
            "INSERT INTO store_meta (key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    async def memory_vectors(
        self, memory_ids: Sequence[str], model_id: str
    ) -> dict[str, np.ndarray]:
        """The stored vectors (of model_id) of memories, by memory id."""
        rows = await self.reader.execute_fetchall(
            "SELECT memory_id, vector FROM vectors WHERE model_id = ? "
            "AND memory_id IN (SELECT value FROM json_each(?))",
            (model_id, json.dumps(list(memory_ids))),
        )
        return {memory_id: unblob(blob) for memory_id, blob in rows}

    async def vector_models(self) -> dict[str, int]:
        """How many vectors each embedding model made."""
        rows = await self.reader.execute_fetchall(VECTOR_MODELS)
        return {r[0]: r[1] for r in rows}

    async def get_many(
        self,
        reach: Reach,
        memory_ids: Sequence[str],
        layers: Sequence[str] = (),
        include_superseded: bool = True,
    ) -> dict[str, MemoryRow]:
        """The rows with these ids that lie inside the reach (and layers, when given), by id."""
        if not memory_ids:
            return {}
        where, params = _filters(reach, layers, include_superseded)
        # Driven by the ids (CROSS JOIN fixes the order), not by a scan of the owner's rows.
        rows = await self.keyed_read(
            len(memory_ids),
            f"SELECT {_M_COLUMNS} FROM json_each(?) AS j CROSS JOIN memories m ON m.id = j.value "
            f"{_where(where)}",
            (json.dumps(list(memory_ids)), *params),
        )
        found = (_row(r) for r in rows)
        return {row.id: row for row in found}

    async def count_buckets(self, reach: Reach, query: CountQuery) -> list[int]:
        """Rows created in each of query.buckets consecutive windows of query.bucket_s."""
        where, params = _filters(
            reach, query.layers, query.include_superseded, query.exclude_layers
        )
        end = query.start + query.bucket_s * query.buckets
        where.append("m.created_at >= ? AND m.created_at < ?")
        params.extend([query.start, end])
        rows = await self.reader.execute_fetchall(
            f"SELECT CAST((m.created_at - ?) / ? AS INTEGER) AS bucket, count(*) "
            f"FROM memories m {_where(where)} GROUP BY bucket",
            (query.start, query.bucket_s, *params),
        )
        counts = [0] * query.buckets
        for bucket, count in rows:
            counts[min(int(bucket), query.buckets - 1)] += count
        return counts

    async def list_rows(self, reach: Reach, query: ListQuery) -> ListPage:
        """A page of rows inside a reach, how many rows match in all, and the last one's place."""
        where, params = _filters(
            reach, query.layers, query.include_superseded, query.exclude_layers
        )
        if query.session_id:
            where.append("m.session_id = ?")
            params.append(query.session_id)
        if query.extraction_status:
            where.append("m.extraction_status = ?")
            params.append(query.extraction_status)
        if query.created_after is not None:
            where.append("m.created_at > ?")
            params.append(query.created_after)
        if query.created_before is not None:
            where.append("m.created_at < ?")
            params.append(query.created_before)
        replaced, replaced_params = query.replaced_sql()
        where.extend(replaced)
        params.extend(replaced_params)
        if query.label:
            where.append("m.label = ?")
            params.append(query.label)
        if query.source_id:
            where.append("EXISTS (SELECT 1 FROM json_each(m.source_ids) WHERE value = ?)")
            params.append(query.source_id)
        if query.contains:
            where.append("holds_text(m.content, ?)")
            params.append(query.contains.lower())
        if query.tries_below:
            where.append("m.extraction_tries < ?")
            params.append(query.tries_below)
        modes, modes_params = query.write_modes_sql()
        where += modes
        params += modes_params
        past, past_params = query.past_sql()
        order = "DESC" if query.newest_first else "ASC"
        rows = await self.reader.execute_fetchall(
            f"SELECT {_M_COLUMNS}, m.seq FROM memories m {_where(where + past)} "
            f"ORDER BY m.created_at {order}, m.seq {order} LIMIT ? OFFSET ?",
            (*params, *past_params, query.limit, query.offset),
        )
        total_rows = await self.reader.execute_fetchall(
            f"SELECT count(*) FROM memories m {_where(where)}", params
        )
        return list_page(list(rows), next(iter(total_rows))[0])

    async def row_seq_high(self) -> int:
        """The highest row sequence number handed out (about how many rows were ever stored)."""
        rows = await self.keyed_read(1, "SELECT max(seq) FROM memories", ())
        return int(next(iter(rows))[0] or 0)

    async def user_row_count(self, user_id: str) -> int:
        """How many rows (live or retired) a user has."""
        rows = await self.reader.execute_fetchall(
            "SELECT count(*) FROM memories WHERE user_id = ?", (user_id,)
        )
        return int(next(iter(rows))[0])

    async def text_search(
        self,
        index: str,
        terms: Sequence[str],
        least: int,
        reach: Reach,
        layers: Sequence[str],
        include_superseded: bool,
        k: int,
    ) -> list[tuple[MemoryRow, float, int]]:
        """Keyword search of one keyword index (see fulltext.search)."""
        return await fulltext.search(
            self, fulltext.BY_NAME[index], terms, least, reach, layers, include_superseded, k
        )

    async def owner_counts(self, reach: Reach) -> list[tuple[str, str, int, int, float]]:
        """Every owner (user, agent) with rows in the reach: live and retired row counts and
        the last write, most recently written first."""
        where, owned = reach.sql()
        rows = await self.reader.execute_fetchall(
            "SELECT user_id, agent_id, sum(status = ?), sum(status != ?), max(created_at) "
            f"FROM memories {_where(where)} "
            "GROUP BY user_id, agent_id ORDER BY max(created_at) DESC, user_id, agent_id",
            (ACTIVE, ACTIVE, *owned),
        )
        return [(u, a, int(live), int(retired), float(last)) for u, a, live, retired, last in rows]

    async def text_ids_within(
        self,
        index: fulltext.TextIndex,
        reach: Reach,
        layers: Sequence[str],
        include_superseded: bool,
        most: int,
    ) -> list[int] | None:
        """The keyword-index ids of the rows inside reach and layers; None past `most`."""
        where, params = _filters(reach, layers, include_superseded)
        rows = await self.text_reader(index.name).execute_fetchall(
            f"SELECT {index.ids} {_where(where)} LIMIT ?", (*params, most + 1)
        )
        ids = [int(r[0]) for r in rows]
        return None if len(ids) > most else ids

    async def rows_at_text_hits(
        self,
        index: fulltext.TextIndex,
        rowids: Sequence[int],
        reach: Reach,
        layers: Sequence[str],
        include_superseded: bool,
    ) -> dict[int, tuple[MemoryRow, str]]:
        """The rows behind keyword-index rowids (joined as the index says), with the indexed
        text, keeping only those inside reach and layers."""
        if not rowids:
            return {}
        where, params = _filters(reach, layers, include_superseded)
        rows = await self.keyed_read(
            len(rowids),
            f"SELECT {_M_COLUMNS}, {index.text}, j.value FROM json_each(?) AS j {index.join} "
            f"{_where(where)}",
            (json.dumps(list(rowids)), *params),
            self.text_reader(index.name),
        )
        return {int(r[ROW_WIDTH + 1]): (_row(r), str(r[ROW_WIDTH])) for r in rows}

    async def replaced_by(
        self, rows: Sequence[MemoryRow], depth: int = 5
    ) -> dict[str, list[MemoryRow]]:
        """For each row's id, the rows of its owner it replaced (and they in turn replaced),
        newest first."""

        async def replacing(frontier: list[str]) -> Iterable[Sequence[Any]]:
            return await self.keyed_read(
                len(frontier),
                # "!= ''" lets the partial index on superseded_by serve (not a scan of every row).
                f"SELECT {_COLUMNS} FROM memories WHERE superseded_by != '' AND superseded_by IN "
                "(SELECT value FROM json_each(?)) ORDER BY invalid_at DESC, seq DESC",
                (json.dumps(frontier),),
            )

        return await replacement_chains(rows, depth, replacing)

    async def turns_followed(
        self, ids: Sequence[str], layers: Sequence[str], gap_s: float
    ) -> dict[str, str]:
        """For each id of a row in one of layers with a session: the row before it in that
        session (same owner and layer), when it was written at most gap_s earlier."""
        if not ids or not layers:
            return {}
        rows = await self.keyed_read(
            len(ids),
            # The previous seq is found through the neighbours index first; its age is checked
            # after, so an old sitting costs one lookup, not a walk back through it.
            "WITH hit AS (SELECT m.id, m.created_at, (SELECT p.seq FROM memories p "
            "WHERE p.user_id = m.user_id AND p.agent_id = m.agent_id "
            "AND p.session_id = m.session_id AND p.layer = m.layer AND p.seq < m.seq "
            "ORDER BY p.seq DESC LIMIT 1) AS before_seq FROM memories m "
            "WHERE m.id IN (SELECT value FROM json_each(?)) AND m.session_id != '' "
            "AND m.layer IN (SELECT value FROM json_each(?))) "
            "SELECT hit.id, p.id FROM hit JOIN memories p ON p.seq = hit.before_seq "
            "WHERE p.created_at >= hit.created_at - ?",
            (json.dumps(list(ids)), json.dumps(list(layers)), gap_s),
        )
        return {memory_id: before for memory_id, before in rows}

    async def memories_of_keys(self, keys: Sequence[int]) -> dict[int, tuple[str, str]]:
        """The memory behind each vector key (own or extra) that still exists, with the text of
        the key when it is one of its memory's sentences ("" otherwise)."""
        if not keys:
            return {}
        own, extra = split_keys(keys)
        rows = await self.keyed_read(
            len(keys),
            MEMORIES_OF_KEYS,
            (json.dumps(own), CLAUSE_KEY_OFFSET, CLAUSE, json.dumps(extra)),
        )
        return {int(key): (memory_id, text) for key, memory_id, text in rows}

    async def vector_keys_of(self, user_id: str) -> set[int]:
        """Every vector key of a user's rows (their own vectors and their clause keys)."""
        rows = await self.reader.execute_fetchall(
            "SELECT v.key FROM memories m CROSS JOIN vectors v ON v.memory_id = m.id "
            "WHERE m.user_id = ?",
            (user_id,),
        )
        keys = {int(r[0]) for r in rows}
        clause = await self.reader.execute_fetchall(
            "SELECT mk.key FROM memories m CROSS JOIN memory_keys mk ON mk.memory_id = m.id "
            "WHERE m.user_id = ? AND mk.vector IS NOT NULL",
            (user_id,),
        )
        keys.update(CLAUSE_KEY_OFFSET + int(r[0]) for r in clause)
        return keys

    async def vectors_for_keys(self, keys: Sequence[int], ndim: int) -> np.ndarray:
        """The stored vectors of keys, in the order given."""
        found: dict[int, np.ndarray] = {}
        for start in range(0, len(keys), 5000):
            own, extra = split_keys(keys[start : start + 5000])
            rows = await self.reader.execute_fetchall(
                "SELECT key, vector FROM vectors WHERE key IN (SELECT value FROM json_each(?))",
                (json.dumps(own),),
            )
            for key, blob in rows:
                found[key] = unblob(blob)
            rows = await self.reader.execute_fetchall(
                "SELECT key, vector FROM memory_keys WHERE key IN (SELECT value FROM json_each(?))",
                (json.dumps(extra),),
            )
            for key, blob in rows:
                found[CLAUSE_KEY_OFFSET + key] = unblob(blob)
        matrix = np.zeros((len(keys), ndim), dtype=np.float32)
        for i, key in enumerate(keys):
            matrix[i] = found[int(key)]
        return matrix

    async def graph_counts(self, reach: Reach) -> tuple[int, int]:
        """Live edges in a reach and the distinct entities they join."""
        where, params = _edge_filters(reach)
        where.append("stale = 0 AND invalidated_at IS NULL")
        clause = "WHERE " + " AND ".join(where)
        rows = await self.reader.execute_fetchall(
            f"SELECT count(*), (SELECT count(*) FROM (SELECT subject_key FROM graph_edges "
            f"{clause} UNION SELECT object_key FROM graph_edges {clause})) "
            f"FROM graph_edges {clause}",
            (*params, *params, *params),
        )
        edges, nodes = next(iter(rows))
        return nodes, edges

    async def get_state(self, prefix: str) -> list[tuple[str, str]]:
        """State values whose key starts with prefix."""
        rows = await self.reader.execute_fetchall(
            "SELECT key, value FROM service_state WHERE substr(key, 1, ?) = ? ORDER BY key",
            (len(prefix), prefix),
        )
        return [(r[0], r[1]) for r in rows]

    async def db_bytes(self) -> int:
        """The size of the database with its WAL."""
        total = 0
        for suffix in ("", "-wal"):
            path = self.db_path.with_name(self.db_path.name + suffix)
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total

