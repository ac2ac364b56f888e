"""The PostgreSQL store's schema: created once, and an older version brought up to date."""

from __future__ import annotations

from typing import Any

import asyncpg

from services.store.pg.schema import SCHEMA_VERSION, create_or_migrate

NDIM = 8


async def indexes(conn: asyncpg.Connection) -> set[str]:
    rows = await conn.fetch("SELECT indexname FROM pg_indexes WHERE tablename = 'memories'")
    return {r[0] for r in rows}


async def test_a_version_1_database_loses_the_index_that_long_names_overflow(
    pg_databases: Any,
) -> None:
    conn = await asyncpg.connect(pg_databases.new_dsn())
    try:
        await create_or_migrate(conn, NDIM, "test")
        # As version 1 left it: the neighbours index by user, agent and session.
        await conn.execute(
            "DROP INDEX memories_session_turns; "
            "CREATE INDEX memories_neighbours "
            "ON memories(user_id, agent_id, session_id, layer, seq); "
            "DELETE FROM schema_version; "
            "INSERT INTO schema_version (version, applied_at) VALUES (1, 0)"
        )

        await create_or_migrate(conn, NDIM, "test")
        await create_or_migrate(conn, NDIM, "test")  # and again: nothing more to do

        found = await indexes(conn)
        assert "memories_neighbours" not in found and "memories_session_turns" in found
        versions = await conn.fetch("SELECT version FROM schema_version ORDER BY version")
        assert [r[0] for r in versions] == [1, SCHEMA_VERSION]
    finally:
        await conn.close()
