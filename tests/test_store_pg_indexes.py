"""The PostgreSQL store's HNSW indexes deferred for a bulk load, then built: searches stay right
throughout, and a store starting meanwhile does not build them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import asyncpg
import numpy as np

from services.store.pg.db import Database
from services.store.pg.schema import HNSW_INDEXES
from services.store.pg.vectors import PgVectors
from tests.test_store_pg_search import NDIM, add_clause_keys, add_rows, all_keys, unit


async def hnsw_indexes(db: Database) -> set[str]:
    rows = await db.fetch("SELECT indexname FROM pg_indexes WHERE indexdef LIKE '%hnsw%'")
    return {r[0] for r in rows}


async def all_visible_pages(db: Database) -> int:
    visible = "SELECT relallvisible FROM pg_class WHERE relname = 'memory_keys'"
    return int(await db.fetchval(visible))


def indexes_command(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HYATLAS_STORE_DSN": dsn}
    return subprocess.run(
        [sys.executable, "-m", "services.store.pg.indexes", *args],
        capture_output=True, text=True, env=env, check=False, timeout=600,
    )


async def nearest_found(db: Database, query: np.ndarray) -> tuple[list[int], list[int]]:
    """The 10 keys a search through HNSW's query finds, and the 10 nearest by a plain scan."""
    found = await PgVectors(db).search("alice", query, 10, 50)
    keys, matrix = await all_keys(db, "alice")
    return found.keys.tolist(), keys[np.argsort(-(matrix @ query))[:10]].tolist()


async def test_deferred_indexes_stay_away_across_a_start_and_come_back_when_built(
    pg_databases: Any,
) -> None:
    dsn = pg_databases.new_dsn()
    rng = np.random.default_rng(11)
    db = await Database(dsn).open(NDIM)
    try:
        ids = await add_rows(db, "alice", ["x"] * 200, unit(rng, 200))
        assert await hnsw_indexes(db) == set(HNSW_INDEXES)

        deferred = indexes_command(dsn, "defer")
        assert deferred.returncode == 0, deferred.stderr
        assert json.loads(deferred.stdout) == {
            "deferred": True, "indexes": dict.fromkeys(HNSW_INDEXES),
        }
        await add_rows(db, "bob", ["x"] * 200, unit(rng, 200))
        await add_clause_keys(db, "alice", ids[:100], unit(rng, 100))
        query = unit(rng, 1)[0]
        found, best = await nearest_found(db, query)
        assert found == best  # without an index the search scans: exact
    finally:
        await db.close()

    db = await Database(dsn).open(NDIM)  # as a store starts
    try:
        assert await hnsw_indexes(db) == set()
        assert await all_visible_pages(db) == 0
        built = indexes_command(dsn, "build", "--memory", "64MB", "--workers", "1")
        assert built.returncode == 0, built.stderr
        state = json.loads(built.stdout)
        assert state["deferred"] is False
        assert all(size > 0 for size in state["indexes"].values())
        assert await hnsw_indexes(db) == set(HNSW_INDEXES)
        assert await all_visible_pages(db) > 0  # vacuumed: counts read indexes alone
        found, best = await nearest_found(db, query)
        assert len(set(found) & set(best)) >= 9
    finally:
        await db.close()


async def test_the_command_refuses_a_database_without_the_store_schema(pg_databases: Any) -> None:
    done = indexes_command(pg_databases.new_dsn(), "defer")
    assert done.returncode == 2
    assert "no store schema" in done.stderr
    assert indexes_command("", "status").returncode == 2  # argparse: no DSN


async def test_building_indexes_that_exist_changes_nothing(pg_databases: Any) -> None:
    dsn = pg_databases.new_dsn()
    db = await Database(dsn).open(NDIM)
    try:
        before = await db.fetch("SELECT indexrelid FROM pg_index ORDER BY 1")
        assert indexes_command(dsn, "build").returncode == 0
        assert await db.fetch("SELECT indexrelid FROM pg_index ORDER BY 1") == before
    finally:
        await db.close()
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM store_meta") == 0
    finally:
        await conn.close()
