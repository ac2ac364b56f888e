"""The PostgreSQL store's schema (created once, an older version brought up to date) and its
write transactions' locks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

from services.store.pg.db import Database
from services.store.pg.schema import GIN_PENDING_KB, SCHEMA_VERSION, create_or_migrate
from tests.support import WAIT_CEILING_S, assert_eventually

NDIM = 8


async def indexes(conn: asyncpg.Connection) -> set[str]:
    rows = await conn.fetch("SELECT indexname FROM pg_indexes WHERE tablename = 'memories'")
    return {r[0] for r in rows}


@contextlib.asynccontextmanager
async def fresh_schema(pg_databases: Any) -> AsyncIterator[asyncpg.Connection]:
    """A connection to a new database holding the current schema."""
    conn = await asyncpg.connect(pg_databases.new_dsn())
    try:
        await create_or_migrate(conn, NDIM, "test")
        yield conn
    finally:
        await conn.close()


async def as_version(conn: asyncpg.Connection, version: int, changes: str) -> None:
    """Takes the schema back to how an older version left it: its changes, then the version."""
    await conn.execute(
        f"{changes}; DELETE FROM schema_version; "
        f"INSERT INTO schema_version (version, applied_at) VALUES ({version}, 0)"
    )


async def test_a_version_1_database_loses_the_index_that_long_names_overflow(
    pg_databases: Any,
) -> None:
    async with fresh_schema(pg_databases) as conn:
        # As version 1 left it: the neighbours index by user, agent and session.
        await as_version(
            conn,
            1,
            "DROP INDEX memories_session_turns; "
            "CREATE INDEX memories_neighbours "
            "ON memories(user_id, agent_id, session_id, layer, seq)",
        )

        await create_or_migrate(conn, NDIM, "test")
        await create_or_migrate(conn, NDIM, "test")  # and again: nothing more to do

        found = await indexes(conn)
        assert "memories_neighbours" not in found and "memories_session_turns" in found
        versions = await conn.fetch("SELECT version FROM schema_version ORDER BY version")
        assert [r[0] for r in versions] == [1, SCHEMA_VERSION]


async def gin_options(conn: asyncpg.Connection) -> dict[str, list[str] | None]:
    rows = await conn.fetch(
        "SELECT relname, reloptions FROM pg_class WHERE relname = ANY($1::text[])",
        ["memories_terms", "memory_keys_terms"],
    )
    return {r[0]: r[1] for r in rows}


async def test_keyword_indexes_keep_short_pending_lists_and_a_version_2_database_gets_them(
    pg_databases: Any,
) -> None:
    limit = [f"gin_pending_list_limit={GIN_PENDING_KB}"]
    async with fresh_schema(pg_databases) as conn:
        assert await gin_options(conn) == {"memories_terms": limit, "memory_keys_terms": limit}
        # As version 2 left it: the server's default limit, and rows waiting in the list.
        await as_version(
            conn,
            2,
            "ALTER INDEX memories_terms RESET (gin_pending_list_limit); "
            "ALTER INDEX memory_keys_terms RESET (gin_pending_list_limit); "
            "INSERT INTO memories (id, user_id, layer, content, created_at, updated_at) "
            "VALUES ('m1', 'u', 'l1_turn', 'pending words', 0, 0)",
        )
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        pending = "SELECT pending_tuples FROM pgstatginindex('memories_terms')"
        assert await conn.fetchval(pending) == 1

        await create_or_migrate(conn, NDIM, "test")

        assert await gin_options(conn) == {"memories_terms": limit, "memory_keys_terms": limit}
        assert await conn.fetchval(pending) == 0
        assert await conn.fetchval("SELECT max(version) FROM schema_version") == SCHEMA_VERSION


async def test_a_version_5_databases_keyword_columns_split_its_texts_as_sqlite_does(
    pg_databases: Any,
) -> None:
    async with fresh_schema(pg_databases) as conn:
        # As version 5 left them: the texts as PostgreSQL's English configuration reads them.
        await as_version(
            conn,
            5,
            "ALTER TABLE memories DROP COLUMN content_terms; "
            "ALTER TABLE memories ADD COLUMN content_terms TSVECTOR "
            "GENERATED ALWAYS AS (to_tsvector('english', content)) STORED; "
            "CREATE INDEX memories_terms ON memories USING gin (user_id, content_terms); "
            "ALTER TABLE memory_keys DROP COLUMN text_terms; "
            "ALTER TABLE memory_keys ADD COLUMN text_terms TSVECTOR GENERATED ALWAYS AS ("
            "CASE WHEN kind = 'context' THEN to_tsvector('english', text) END) STORED; "
            "CREATE INDEX memory_keys_terms ON memory_keys USING gin (user_id, text_terms) "
            "WHERE kind = 'context'; "
            "INSERT INTO memories (id, user_id, layer, content, created_at, updated_at) "
            "VALUES ('m1', 'u', 'l2_raw', 'Mail john.doe@example.com about the crème', 0, 0); "
            "INSERT INTO memory_keys (memory_id, user_id, kind, text) "
            "VALUES ('m1', 'u', 'context', 'Mail john.doe@example.com about the crème')",
        )
        holds = (
            "SELECT (SELECT content_terms FROM memories) @@ plainto_tsquery('hyatlas', $1) "
            "AND (SELECT text_terms FROM memory_keys) @@ plainto_tsquery('hyatlas', $1)"
        )
        assert not await conn.fetchval(holds, "doe")

        await create_or_migrate(conn, NDIM, "test")
        await create_or_migrate(conn, NDIM, "test")  # and again: nothing more to do

        for word in ("doe", "example", "creme", "about"):
            assert await conn.fetchval(holds, word), word
        limit = [f"gin_pending_list_limit={GIN_PENDING_KB}"]
        assert await gin_options(conn) == {"memories_terms": limit, "memory_keys_terms": limit}
        assert await conn.fetchval("SELECT max(version) FROM schema_version") == SCHEMA_VERSION


async def test_a_version_6_databases_rows_get_the_writers_utc_offset_read_as_utc(
    pg_databases: Any,
) -> None:
    async with fresh_schema(pg_databases) as conn:
        # As version 6 left it: no writer's offset on a row.
        await as_version(
            conn,
            6,
            "ALTER TABLE memories DROP COLUMN utc_offset_minutes; "
            "INSERT INTO memories (id, user_id, layer, content, created_at, updated_at) "
            "VALUES ('m1', 'u', 'l2_raw', 'said before offsets were kept', 0, 0)",
        )

        await create_or_migrate(conn, NDIM, "test")
        await create_or_migrate(conn, NDIM, "test")  # and again: nothing more to do

        assert await conn.fetchval("SELECT utc_offset_minutes FROM memories") == 0
        assert await conn.fetchval("SELECT max(version) FROM schema_version") == SCHEMA_VERSION


async def test_a_version_4_databases_edges_get_name_keys_that_ignore_case_in_any_script(
    pg_databases: Any,
) -> None:
    async with fresh_schema(pg_databases) as conn:
        # As version 4 left it: edges without name keys.
        await as_version(
            conn,
            4,
            "ALTER TABLE graph_edges DROP COLUMN subject_key, DROP COLUMN relation_key, "
            "DROP COLUMN object_key; "
            "INSERT INTO graph_edges (id, user_id, subject, relation, object, recorded_at) "
            "VALUES ('e1', 'u', 'Émile', 'Lives In', 'ΣΟΦΊΑ', 0)",
        )

        await create_or_migrate(conn, NDIM, "test")

        keys = await conn.fetchrow("SELECT subject_key, relation_key, object_key FROM graph_edges")
        assert tuple(keys) == ("émile", "lives in", "σοφία")
        assert await conn.fetchval("SELECT max(version) FROM schema_version") == SCHEMA_VERSION


async def test_a_start_while_a_write_is_open_waits_for_it_rather_than_lock_tables_beside_it(
    pg_databases: Any,
) -> None:
    dsn = pg_databases.new_dsn()
    database = await Database(dsn).open(NDIM)
    starting = await asyncpg.connect(dsn)
    try:
        async with database.writing() as write:
            # A delete locks memory_keys first, the schema's statements memories first.
            await write.execute("DELETE FROM memory_keys WHERE memory_id = 'none'")
            start = asyncio.create_task(create_or_migrate(starting, NDIM, "test"))
            await assert_eventually(lambda: _waits_on_advisory_lock(database, starting))
            await write.execute("DELETE FROM memories WHERE id = 'none'")
        await asyncio.wait_for(start, WAIT_CEILING_S)
    finally:
        await starting.close()
        await database.close()


async def _waits_on_advisory_lock(database: Database, conn: asyncpg.Connection) -> bool:
    waiting = await database.fetchval(
        "SELECT wait_event FROM pg_stat_activity WHERE pid = ?", conn.get_server_pid()
    )
    return bool(waiting == "advisory")


async def test_a_write_sees_what_the_write_before_it_committed_whatever_the_default_isolation(
    pg_databases: Any,
) -> None:
    dsn = pg_databases.new_dsn()
    await (await Database(dsn).open(NDIM)).close()  # the schema
    conn = await asyncpg.connect(dsn)
    name = await conn.fetchval("SELECT current_database()")
    await conn.execute(f"ALTER DATABASE {name} SET default_transaction_isolation = 'serializable'")
    await conn.close()
    first, second = await Database(dsn).open(NDIM), await Database(dsn).open(NDIM)
    try:
        async with first.writing() as write:
            await write.execute("INSERT INTO store_meta (key, value) VALUES ('k', 'first')")
            seen: asyncio.Future[str] = asyncio.get_running_loop().create_future()

            async def read_after_lock() -> None:
                async with second.writing() as later:
                    seen.set_result(
                        await later.fetchval("SELECT value FROM store_meta WHERE key = 'k'")
                    )

            reader = asyncio.create_task(read_after_lock())
            await assert_eventually(lambda: _any_waits_on_advisory_lock(first))
        await asyncio.wait_for(reader, WAIT_CEILING_S)
        assert seen.result() == "first"
    finally:
        await first.close()
        await second.close()


async def _any_waits_on_advisory_lock(database: Database) -> bool:
    waiting = await database.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' "
        "AND datname = current_database()"
    )
    return bool(waiting == 1)
