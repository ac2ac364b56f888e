"""Writes on PostgreSQL: the vacuum that takes a deleted text out of the tables runs after the
write lock is released, one pass at a time, and the delete answers once a pass covering it ran;
a write is dated once it holds the replicas' write lock."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import asyncpg

from services.store.pg.schema import WRITE_LOCK
from services.store.server import running_server
from shared.pb import store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from tests.store_state import store_config
from tests.support import WAIT_CEILING_S, assert_eventually
from tests.test_store import apply, insert, listed

VACUUM = "VACUUM memories, memory_keys, audit"


@contextlib.asynccontextmanager
async def vacuum_held(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection holding the lock a VACUUM of memories takes, which writes do not take: a
    vacuum started meanwhile waits till the block ends."""
    async with connected(dsn) as conn, conn.transaction():
        await conn.execute("LOCK TABLE memories IN SHARE UPDATE EXCLUSIVE MODE")
        yield conn


@contextlib.asynccontextmanager
async def connected(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(dsn)
    try:
        yield conn
    finally:
        await conn.close()


async def vacuum_waits(conn: asyncpg.Connection) -> bool:
    """Whether the store's vacuum is waiting for a lock."""
    waiting = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE query = $1 AND wait_event_type = 'Lock'",
        VACUUM,
    )
    return bool(waiting)


async def vacuums_of_memories(conn: asyncpg.Connection) -> int:
    """How many times memories was vacuumed by hand (the store's passes; not autovacuum)."""
    sql = "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'memories'"
    return int(await conn.fetchval(sql))


@dataclass
class PgStore:
    """A store on a fresh PostgreSQL database, its stub, and a connection to watch it with."""

    dsn: str
    stub: store_pb2_grpc.StoreStub
    watcher: asyncpg.Connection


@contextlib.asynccontextmanager
async def pg_store(
    tmp_path: Path, embedder_address: str, pg_databases: Any
) -> AsyncIterator[PgStore]:
    dsn = pg_databases.new_dsn()
    config = replace(store_config(tmp_path, embedder_address), store_dsn=dsn)
    async with (
        running_server(config) as address,
        open_channel(address) as channel,
        connected(dsn) as watcher,
    ):
        yield PgStore(dsn, store_pb2_grpc.StoreStub(channel), watcher)


async def test_writes_go_on_while_a_deletes_vacuum_waits_and_deletes_meanwhile_share_one_pass(
    tmp_path: Path, embedder_address: str, pg_databases: Any
) -> None:
    async with pg_store(tmp_path, embedder_address, pg_databases) as pg:
        stub, watcher = pg.stub, pg.watcher
        rows = await apply(stub, *(insert(f"the secret of room {n}") for n in range(4)))
        deletes = [store_pb2.Op(delete=store_pb2.DeleteOp(id=row.id)) for row in rows]
        before = await vacuums_of_memories(watcher)
        async with vacuum_held(pg.dsn):
            first = asyncio.create_task(apply(stub, deletes[0]))
            await assert_eventually(lambda: vacuum_waits(watcher))
            # A ceiling, not a timing: with the vacuum under the write lock these never end.
            await asyncio.wait_for(apply(stub, insert("a write meanwhile")), WAIT_CEILING_S)
            later = [asyncio.create_task(apply(stub, op)) for op in deletes[1:]]
            # Committed: their rows are gone, their replies wait for a vacuum that covers them.
            await assert_eventually(lambda: only(stub, "a write meanwhile"))
            assert not any(task.done() for task in (first, *later))
        await asyncio.wait_for(asyncio.gather(first, *later), WAIT_CEILING_S)
        # The first delete's pass, and one for the three that came while it waited.
        assert await vacuums_of_memories(watcher) == before + 2


async def only(stub: store_pb2_grpc.StoreStub, content: str) -> bool:
    return await listed(stub) == [content]


async def write_waits(conn: asyncpg.Connection) -> bool:
    """Whether a session waits for an advisory lock (the store's write waiting for WRITE_LOCK)."""
    sql = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    return bool(await conn.fetchval(sql))


async def test_a_write_that_waited_for_another_replicas_lock_is_dated_after_it(
    tmp_path: Path, embedder_address: str, pg_databases: Any
) -> None:
    # Write times follow the order writes commit in, whichever replica made them.
    async with (
        pg_store(tmp_path, embedder_address, pg_databases) as pg,
        connected(pg.dsn) as other_replica,
    ):
        async with other_replica.transaction():
            await other_replica.execute("SELECT pg_advisory_xact_lock($1)", WRITE_LOCK)
            write = asyncio.create_task(apply(pg.stub, insert("written after the other replica")))
            await assert_eventually(lambda: write_waits(pg.watcher))
            released_after = time.time()
        (row,) = await asyncio.wait_for(write, WAIT_CEILING_S)
        assert row.created_at >= released_after
