"""PostgreSQL reads of committed rows, and the write transactions (rows.Rows on asyncpg)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import numpy as np
from pgvector import HalfVector

from services.store.keys import CLAUSE
from services.store.model import (
    ACTIVE,
    EVERY_ROW,
    CountQuery,
    ListPage,
    ListQuery,
    MemoryRow,
    Reach,
)
from services.store.pg import text
from services.store.pg.db import Database
from services.store.pg.vacuum import Vacuums
from services.store.pg.writes import PgWrites
from services.store.repo import (
    _COLUMNS,
    _M_COLUMNS,
    CLAUSE_KEY_OFFSET,
    SharedReads,
    _edge_filters,
    _filters,
    _row,
    _where,
    list_page,
    replacement_chains,
    split_keys,
)

# SQLite orders text by its bytes; PostgreSQL by the database's collation unless told.
_BYTES = 'COLLATE "C"'


def _array(vector: HalfVector) -> np.ndarray:
    """A stored halfvec as the float32 vector the rooms work with."""
    return vector.to_numpy().astype(np.float32)


class PgRepo(SharedReads):
    """The store's rows in PostgreSQL (see rows.Rows for what each method does)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._vacuums = Vacuums(db)

    async def _fetch(self, sql: str, *params: Any) -> Sequence[Sequence[Any]]:
        return list(await self.db.fetch(sql, *params))

    async def answers(self) -> bool:
        """Whether the database server answers a trivial query in time."""
        return await self.db.answers()

    @property
    def keyword_problem(self) -> str:
        """Never: keyword search reads the database's own text index, written with the rows."""
        return ""

    async def close(self) -> None:
        """Waits for the vacuum passes asked for (the pool is the caller's to close)."""
        await self._vacuums.close()

    async def checkpoint(self) -> None:
        """Nothing: PostgreSQL's write-ahead log is the server's, and a deleted text leaves
        the tables through purge_erased, which needs no write lock."""

    async def purge_erased(self) -> None:
        """Vacuums the tables that hold text, so the tuples of rows erased before the call are
        pruned from their pages (PostgreSQL keeps a deleted tuple until a vacuum): returns once
        a pass that began after the call has ended, one pass shared by the callers meanwhile."""
        await self._vacuums.pass_after_now()

    @contextlib.asynccontextmanager
    async def transaction(
        self, committed: Callable[[], Awaitable[None]] | None = None
    ) -> AsyncIterator[PgWrites]:
        """One write transaction holding the write lock of every replica; `committed` runs
        once it is committed."""
        async with self.db.writing() as conn:
            yield PgWrites(conn)
        if committed is not None:
            await committed()

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
        """Keyword search of one tsvector index (see pg.text.search)."""
        return await text.search(self.db, index, terms, least, reach, layers, include_superseded, k)

    async def set_meta(self, key: str, value: str) -> None:
        """Sets a value of the store_meta table."""
        await self.db.execute(
            "INSERT INTO store_meta (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            key, value,
        )

    async def memory_vectors(
        self, memory_ids: Sequence[str], model_id: str
    ) -> dict[str, np.ndarray]:
        """The stored vectors (of model_id) of memories, by memory id."""
        rows = await self.db.fetch(
            "SELECT memory_id, vector FROM vectors WHERE model_id = ? "
            "AND memory_id = ANY(?::text[])",
            model_id, list(memory_ids),
        )
        return {memory_id: _array(vector) for memory_id, vector in rows}

    async def vector_models(self) -> dict[str, int]:
        """How many vectors each embedding model made."""
        rows = await self.db.fetch("SELECT model_id, count(*) FROM vectors GROUP BY model_id")
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
        where.append("m.id = ANY(?::text[])")
        rows = await self.db.fetch(
            f"SELECT {_M_COLUMNS} FROM memories m {_where(where)}", *params, list(memory_ids)
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
        # floor(), as SQLite's CAST AS INTEGER does for the non-negative offsets kept here.
        rows = await self.db.fetch(
            "SELECT floor((m.created_at - ?) / ?) AS bucket, count(*) "
            f"FROM memories m {_where(where)} GROUP BY bucket",
            query.start, query.bucket_s, *params,
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
        for column, value in (
            ("session_id", query.session_id),
            ("extraction_status", query.extraction_status),
            ("label", query.label),
        ):
            if value:
                where.append(f"m.{column} = ?")
                params.append(value)
        replaced, replaced_params = query.replaced_sql()
        where.extend(replaced)
        params.extend(replaced_params)
        if query.source_id:
            # Containment (@>), not jsonb's `?` operator: numbered() takes every `?` for one.
            where.append("m.source_ids::jsonb @> jsonb_build_array(?::text)")
            params.append(query.source_id)
        if query.contains:
            where.append("strpos(lower(m.content), lower(?::text)) > 0")
            params.append(query.contains)
        if query.tries_below:
            where.append("m.extraction_tries < ?")
            params.append(query.tries_below)
        modes, modes_params = query.write_modes_sql()
        where += modes
        params += modes_params
        for compare, bound in ((">", query.created_after), ("<", query.created_before)):
            if bound is not None:
                where.append(f"m.created_at {compare} ?")
                params.append(bound)
        past, past_params = query.past_sql()
        order = "DESC" if query.newest_first else "ASC"
        rows = await self.db.fetch(
            f"SELECT {_M_COLUMNS}, m.seq FROM memories m {_where(where + past)} "
            f"ORDER BY m.created_at {order}, m.seq {order} LIMIT ? OFFSET ?",
            *params, *past_params, None if query.limit == EVERY_ROW else query.limit,
            query.offset,
        )
        total = await self.db.fetchval(f"SELECT count(*) FROM memories m {_where(where)}", *params)
        return list_page(rows, int(total))

    async def replaced_by(
        self, rows: Sequence[MemoryRow], depth: int = 5
    ) -> dict[str, list[MemoryRow]]:
        """For each row's id, the rows of its owner it replaced (and they in turn replaced),
        newest first."""

        async def replacing(frontier: list[str]) -> Iterable[Sequence[Any]]:
            return await self.db.fetch(
                # "!= ''" lets the partial index on superseded_by serve; NULLS LAST as in SQLite.
                f"SELECT {_COLUMNS} FROM memories WHERE superseded_by != '' "
                "AND superseded_by = ANY(?::text[]) ORDER BY invalid_at DESC NULLS LAST, seq DESC",
                frontier,
            )

        return await replacement_chains(rows, depth, replacing)

    async def turns_followed(
        self, ids: Sequence[str], layers: Sequence[str], gap_s: float
    ) -> dict[str, str]:
        """For each id of a row in one of layers with a session: the row before it in that
        session (same owner and layer), when it was written at most gap_s earlier."""
        if not ids or not layers:
            return {}
        rows = await self.db.fetch(
            # The previous seq is found through the neighbours index first; its age is checked
            # after, so an old sitting costs one lookup, not a walk back through it.
            "WITH hit AS (SELECT m.id, m.created_at, (SELECT p.seq FROM memories p "
            "WHERE p.user_id = m.user_id AND p.agent_id = m.agent_id "
            "AND p.session_id = m.session_id AND p.layer = m.layer AND p.seq < m.seq "
            "ORDER BY p.seq DESC LIMIT 1) AS before_seq FROM memories m "
            "WHERE m.id = ANY(?::text[]) AND m.session_id != '' AND m.layer = ANY(?::text[])) "
            "SELECT hit.id, p.id FROM hit JOIN memories p ON p.seq = hit.before_seq "
            "WHERE p.created_at >= hit.created_at - ?",
            list(ids), list(layers), gap_s,
        )
        return {memory_id: before for memory_id, before in rows}

    async def memories_of_keys(self, keys: Sequence[int]) -> dict[int, tuple[str, str]]:
        """The memory behind each vector key (own or extra) that still exists, with the text of
        the key when it is one of its memory's sentences ("" otherwise)."""
        if not keys:
            return {}
        own, extra = split_keys(keys)
        rows = await self.db.fetch(
            "SELECT key, memory_id, '' FROM vectors WHERE key = ANY(?::bigint[]) UNION ALL "
            "SELECT ?::bigint + key, memory_id, CASE WHEN kind = ? THEN text ELSE '' END "
            "FROM memory_keys WHERE key = ANY(?::bigint[])",
            own, CLAUSE_KEY_OFFSET, CLAUSE, extra,
        )
        return {int(key): (memory_id, text) for key, memory_id, text in rows}

    async def graph_counts(self, reach: Reach) -> tuple[int, int]:
        """The distinct entities live edges in a reach join, and those edges (as SQLite's)."""
        where, params = _edge_filters(reach)
        where.append("stale = 0 AND invalidated_at IS NULL")
        clause = _where(where)
        ((edges, nodes),) = await self.db.fetch(
            f"SELECT count(*), (SELECT count(*) FROM (SELECT subject_key FROM graph_edges "
            f"{clause} UNION SELECT object_key FROM graph_edges {clause}) AS entities) "
            f"FROM graph_edges {clause}",
            *params, *params, *params,
        )
        return int(nodes), int(edges)

    async def get_state(self, prefix: str) -> list[tuple[str, str]]:
        """State values whose key starts with prefix."""
        rows = await self.db.fetch(
            f"SELECT key, value FROM service_state WHERE left(key, ?) = ? ORDER BY key {_BYTES}",
            len(prefix), prefix,
        )
        return [(r[0], r[1]) for r in rows]

    async def owner_counts(self, reach: Reach) -> list[tuple[str, str, int, int, float]]:
        """Every owner (user, agent) with rows in the reach: live and retired row counts and
        the last write, most recently written first."""
        where, owned = reach.sql()
        rows = await self.db.fetch(
            "SELECT user_id, agent_id, count(*) FILTER (WHERE status = ?), "
            "count(*) FILTER (WHERE status != ?), max(created_at) "
            f"FROM memories {_where(where)} GROUP BY user_id, agent_id "
            f"ORDER BY max(created_at) DESC, user_id {_BYTES}, agent_id {_BYTES}",
            ACTIVE, ACTIVE, *owned,
        )
        return [(u, a, int(live), int(retired), float(last)) for u, a, live, retired, last in rows]

    async def db_bytes(self) -> int:
        """The size of the database on disk."""
        return int(await self.db.fetchval("SELECT pg_database_size(current_database())"))

