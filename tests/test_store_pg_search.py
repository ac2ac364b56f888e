"""Nearest-neighbour and keyword search of the PostgreSQL store, below the gRPC service."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from services.store.model import Reach
from services.store.pg import text, vectors
from services.store.pg.db import Database
from services.store.pg.vectors import PgVectors
from services.store.repo import CLAUSE_KEY_OFFSET

NDIM = 8


@pytest.fixture
async def db(pg_databases: Any) -> AsyncIterator[Database]:
    """A fresh database with the store's schema for NDIM-wide vectors."""
    database = await Database(pg_databases.new_dsn()).open(NDIM)
    try:
        yield database
    finally:
        await database.close()


async def add_rows(
    db: Database, user_id: str, contents: list[str], vectors_of: np.ndarray | None = None
) -> list[str]:
    """Rows of one user (with their vectors, when given); their ids, oldest first."""
    ids = [f"{user_id}-{i}" for i in range(len(contents))]
    async with db.writing() as conn:
        await conn.executemany(
            "INSERT INTO memories (id, user_id, layer, content, created_at, updated_at) "
            "VALUES ($1, $2, 'l3_fact', $3, $4, $4)",
            [(ids[i], user_id, content, float(i)) for i, content in enumerate(contents)],
        )
        if vectors_of is not None:
            await conn.executemany(
                "INSERT INTO vectors (memory_id, user_id, model_id, vector) "
                "VALUES ($1, $2, 'm', $3)",
                [(id_, user_id, v) for id_, v in zip(ids, vectors_of, strict=True)],
            )
    return ids


async def add_clause_keys(db: Database, user_id: str, ids: list[str], of: np.ndarray) -> None:
    """One clause vector for each of the rows."""
    async with db.writing() as conn:
        await conn.executemany(
            "INSERT INTO memory_keys (memory_id, user_id, kind, text, model_id, vector) "
            "VALUES ($1, $2, 'clause', 'a clause', 'm', $3)",
            [(id_, user_id, v) for id_, v in zip(ids, of, strict=True)],
        )


async def all_keys(db: Database, user_id: str) -> tuple[np.ndarray, np.ndarray]:
    """Every key of a user's and its vector, by a plain scan."""
    rows = await db.fetch(
        "SELECT key, vector FROM vectors WHERE user_id = ? UNION ALL "
        "SELECT ? + key, vector FROM memory_keys WHERE user_id = ? AND vector IS NOT NULL",
        user_id, CLAUSE_KEY_OFFSET, user_id,
    )
    keys = np.array([r[0] for r in rows], dtype=np.uint64)
    return keys, np.stack([r[1].to_numpy() for r in rows]).astype(np.float32)


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    matrix = rng.standard_normal((n, NDIM)).astype(np.float32)
    return matrix / np.linalg.norm(matrix, axis=1, keepdims=True)


@pytest.mark.parametrize("exact_up_to", [10_000, 50], ids=["exact", "hnsw"])
async def test_search_finds_a_users_nearest_own_and_clause_keys_best_first(
    db: Database, exact_up_to: int
) -> None:
    rng = np.random.default_rng(7)
    ids = await add_rows(db, "alice", ["x"] * 300, unit(rng, 300))
    await add_clause_keys(db, "alice", ids[:100], unit(rng, 100))
    await add_rows(db, "bob", ["x"] * 300, unit(rng, 300))
    query = unit(rng, 1)[0]

    found = await PgVectors(db).search("alice", query, 20, exact_up_to)

    keys, matrix = await all_keys(db, "alice")
    best = keys[np.argsort(-(matrix @ query))[:20]]
    assert found.size == 400 if exact_up_to >= 400 else found.size > exact_up_to
    assert len(set(found.keys.tolist()) & set(best.tolist())) >= 18
    assert list(found.scores) == sorted(found.scores, reverse=True)
    assert any(key >= CLAUSE_KEY_OFFSET for key in found.keys.tolist())
    assert np.allclose(found.scores[0], float(matrix[keys == found.keys[0]][0] @ query), atol=2e-3)


async def test_a_users_size_is_exact_up_to_the_bound_and_only_above_it_past_that(
    db: Database,
) -> None:
    rng = np.random.default_rng(5)
    ids = await add_rows(db, "alice", ["x"] * 30, unit(rng, 30))
    await add_clause_keys(db, "alice", ids[:10], unit(rng, 10))
    await add_rows(db, "bob", ["x"] * 5, unit(rng, 5))
    sizes = PgVectors(db)
    assert await sizes.size_up_to("alice", 40) == 40
    assert await sizes.size_up_to("alice", 1000) == 40
    assert 39 < await sizes.size_up_to("alice", 39) <= 80
    assert 5 < await sizes.size_up_to("alice", 5) < 40
    assert await sizes.size_up_to("bob", 5) == 5


async def test_a_user_without_keys_finds_nothing(db: Database) -> None:
    found = await PgVectors(db).search("nobody", unit(np.random.default_rng(1), 1)[0], 10, 100)
    assert found.size == 0 and len(found.keys) == 0


async def test_a_small_users_search_scans_their_rows_and_never_the_hnsw_index(
    db: Database,
) -> None:
    rng = np.random.default_rng(3)
    for user in ("alice", "bob", "carol"):
        await add_rows(db, user, ["x"] * 500, unit(rng, 500))
    await db.execute("ANALYZE")
    plan = await db.fetch(
        "EXPLAIN " + vectors._EXACT,
        unit(rng, 1)[0], "alice", CLAUSE_KEY_OFFSET, unit(rng, 1)[0], "alice", 20,
    )
    lines = "\n".join(r[0] for r in plan)
    assert "hnsw" not in lines


async def test_vectors_are_returned_for_the_users_own_keys_only(db: Database) -> None:
    rng = np.random.default_rng(5)
    ids = await add_rows(db, "alice", ["x", "y"], unit(rng, 2))
    await add_clause_keys(db, "alice", ids[:1], unit(rng, 1))
    await add_rows(db, "bob", ["z"], unit(rng, 1))
    keys, _ = await all_keys(db, "alice")
    bobs, _ = await all_keys(db, "bob")
    asked = [int(keys[-1]), int(bobs[0]), int(keys[0]), CLAUSE_KEY_OFFSET + 999]

    held, matrix = await PgVectors(db).vectors("alice", asked)

    assert held == [int(keys[-1]), int(keys[0])]
    assert matrix.shape == (2, NDIM) and matrix.dtype == np.float32


async def test_keyword_search_counts_a_stop_word_the_text_search_drops(db: Database) -> None:
    # PostgreSQL's English configuration drops "over"; the row must still hold it to count.
    await add_rows(db, "alice", ["the fox jumps over the wall", "the fox jumps onto the wall"])
    found = await text.search(
        db, "own", ["fox", "over", "wall"], 3, Reach(("alice",)), [], False, 10
    )
    assert [(row.content, held) for row, _, held in found] == [("the fox jumps over the wall", 3)]


async def test_keyword_search_keeps_to_the_reach(db: Database) -> None:
    await add_rows(db, "alice", ["tulips in the garden"])
    await add_rows(db, "bob", ["tulips in the garden"])
    found = await text.search(db, "own", ["tulips"], 1, Reach(("bob",)), [], False, 10)
    assert [row.user_id for row, _, _ in found] == ["bob"]



async def test_a_relaxed_keyword_search_ranks_a_rare_term_above_common_ones(
    db: Database,
) -> None:
    await add_rows(db, "alice", ["we said hello at the time"] * 20 + ["an adoption agency"])
    found = await text.search(
        db, "own", ["said", "time", "adoption"], 1, Reach(("alice",)), [], False, 5
    )
    assert found[0][0].content == "an adoption agency" and found[0][2] == 1
    assert [held for _, _, held in found[1:]] == [2, 2, 2, 2]
