"""The PostgreSQL store's HNSW indexes, deferred for a bulk load and built after it.

pgvector adds a vector to an HNSW graph one insert at a time, and the store inserts about five
vectors a memory under its write lock: a bulk load of a large store (`hyatlas migrate`, an
import of millions of rows) spends most of its time there. Building the graphs once, after the
rows are in, uses every core (parallel maintenance workers): seeding 19,000 memories ran at
348 memories/s so, the build included, against 122/s with the indexes kept (README).

    python -m services.store.pg.indexes defer|build|status [--dsn DSN]

`defer` drops the HNSW indexes and records that they are deferred, so a store starting meanwhile
does not build them again; searches stay right, scanning every vector instead. `build` creates
them (writes wait meanwhile), clears the record, then vacuums and analyzes the loaded tables.
The DSN is `HYATLAS_STORE_DSN` unless given; the store must have started on the database once,
to create its schema.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

import asyncpg
from tqdm import tqdm

from services.store.pg.schema import HNSW_DEFERRED, HNSW_INDEXES, hnsw_deferred, lock_schema
from shared.errors import ConfigError

# How often the build's progress bar asks the server how far it is.
PROGRESS_EVERY_S = 1.0


async def defer(conn: asyncpg.Connection) -> None:
    """Drops the HNSW indexes and records that they are deferred."""
    async with conn.transaction():
        await lock_schema(conn)
        await conn.execute(
            "INSERT INTO store_meta (key, value) VALUES ($1, $2) "
            "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
            HNSW_DEFERRED,
            str(time.time()),
        )
        for name in HNSW_INDEXES:
            await conn.execute(f"DROP INDEX IF EXISTS {name}")


async def build(
    conn: asyncpg.Connection, memory: str | None = None, workers: int | None = None
) -> None:
    """Creates the HNSW indexes that are missing, clears the deferral, then vacuums and
    analyzes the tables; with memory (such as '4GB': the graph is built fastest when it fits)
    and workers for this build only."""
    async with conn.transaction():
        await lock_schema(conn)
        if memory is not None:
            await conn.execute("SELECT set_config('maintenance_work_mem', $1, true)", memory)
        if workers is not None:
            await conn.execute(
                "SELECT set_config('max_parallel_maintenance_workers', $1, true)", str(workers)
            )
        for create in HNSW_INDEXES.values():
            await conn.execute(create)
        await conn.execute("DELETE FROM store_meta WHERE key = $1", HNSW_DEFERRED)
    # The planner's figures of the loaded tables, as a search needs them at once (while the
    # build ran, the server's own ANALYZE had to wait for it), and their pages marked all
    # visible, so an owner's rows are counted from an index alone (pg/text.py).
    await conn.execute("VACUUM (ANALYZE) memories, vectors, memory_keys")


async def status(conn: asyncpg.Connection) -> dict[str, Any]:
    """Whether the indexes are deferred, and each one's size in bytes (None: missing)."""
    sizes = {
        name: await conn.fetchval(
            "SELECT pg_relation_size(to_regclass($1)) WHERE to_regclass($1) IS NOT NULL", name
        )
        for name in HNSW_INDEXES
    }
    return {"deferred": await hnsw_deferred(conn), "indexes": sizes}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    conn = await asyncpg.connect(args.dsn)
    conn.add_log_listener(lambda _conn, message: print(message.message, file=sys.stderr))
    try:
        if not await conn.fetchval("SELECT to_regclass('store_meta') IS NOT NULL"):
            raise ConfigError("the database has no store schema: start the store on it once")
        if args.command == "defer":
            await defer(conn)
        elif args.command == "build":
            began = time.perf_counter()
            watcher = asyncio.create_task(_show_progress(args.dsn, conn.get_server_pid()))
            try:
                await build(conn, args.memory, args.workers)
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            print(f"built in {time.perf_counter() - began:.1f} s", file=sys.stderr)
        return await status(conn)
    finally:
        await conn.close()


async def _show_progress(dsn: str, builder: int) -> None:
    """A bar on stderr of the table blocks the build has read, from PostgreSQL's progress view
    (pgvector reports each table's scan), polled every second until cancelled."""
    conn = await asyncpg.connect(dsn)
    bar = tqdm(desc="hnsw", unit=" blocks", file=sys.stderr)
    try:
        while True:
            row = await conn.fetchrow(
                "SELECT relid::regclass::text AS tab, phase, blocks_total, blocks_done "
                "FROM pg_stat_progress_create_index WHERE pid = $1",
                builder,
            )
            if row is not None:
                bar.set_description(f"hnsw on {row['tab']}: {row['phase']}", refresh=False)
                bar.total = row["blocks_total"] or None
                bar.n = row["blocks_done"]
                bar.refresh()
            await asyncio.sleep(PROGRESS_EVERY_S)
    finally:
        bar.close()
        await conn.close()


def main(argv: list[str] | None = None) -> int:
    """Runs one command and prints the indexes' state as JSON; exit 2 on a refusal."""
    top = argparse.ArgumentParser(
        prog="python -m services.store.pg.indexes", description=__doc__.split("\n\n")[0]
    )
    top.add_argument("command", choices=("defer", "build", "status"))
    top.add_argument("--dsn", default=os.environ.get("HYATLAS_STORE_DSN", ""))
    top.add_argument("--memory", help="maintenance_work_mem for the build, such as 4GB")
    top.add_argument("--workers", type=int, help="parallel maintenance workers for the build")
    args = top.parse_args(argv)
    if not args.dsn.startswith(("postgresql://", "postgres://")):
        top.error("a postgresql:// DSN is needed (--dsn or HYATLAS_STORE_DSN)")
    try:
        print(json.dumps(asyncio.run(_run(args)), indent=2))
    except (ConfigError, asyncpg.PostgresError, OSError) as exc:
        print(f"indexes {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
