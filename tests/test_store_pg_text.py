"""The PostgreSQL keyword search's shortcuts: candidates ranked cheaply first, filters applied
after, postings counted within the budget and cached."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.store import keywords
from services.store.model import Reach
from services.store.pg import text
from services.store.pg.db import Database
from tests.support import assert_eventually

ALICE = Reach(("alice",))


@pytest.fixture
async def db(pg_databases: Any) -> AsyncIterator[Database]:
    """A fresh database with the store's schema."""
    database = await Database(pg_databases.new_dsn()).open(8)
    try:
        yield database
    finally:
        await database.close()


async def add_rows(
    db: Database, contents: list[str], layer: str = "l3_fact", context: bool = False
) -> list[str]:
    """Rows of alice's after those already there (each with a context key of its own text, if
    asked); their ids, oldest first."""
    start = int(await db.fetchval("SELECT count(*) FROM memories"))
    ids = [f"alice-{start + i}" for i in range(len(contents))]
    async with db.writing() as conn:
        await conn.executemany(
            "INSERT INTO memories (id, user_id, layer, content, created_at, updated_at) "
            "VALUES ($1, 'alice', $2, $3, $4, $4)",
            [(id_, layer, content, float(start + i)) for i, (id_, content) in
             enumerate(zip(ids, contents, strict=True))],
        )
        if context:
            await conn.executemany(
                "INSERT INTO memory_keys (memory_id, user_id, kind, text) "
                "VALUES ($1, 'alice', 'context', $2)",
                list(zip(ids, contents, strict=True)),
            )
    return ids


async def test_context_hits_behind_a_page_of_filtered_out_ones_are_still_found(
    db: Database,
) -> None:
    # The best-ranked keys belong to another layer: the search must look past them.
    await add_rows(db, ["tulip tulip tulip"] * 120, layer="l2_raw", context=True)
    wanted = await add_rows(db, ["a tulip among many other words here"] * 3, context=True)
    found = await text.search(db, "context", ["tulip"], 1, ALICE, ["l3_fact"], False, 3)
    assert sorted(row.id for row, _, _ in found) == wanted


async def test_an_old_row_holding_a_rare_term_is_found_past_the_budget(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keywords, "POSTING_BUDGET", 20)
    old = await add_rows(db, ["the lighthouse keeper"])
    await add_rows(db, ["a walk on the beach"] * 60)
    newest = await add_rows(db, ["the beach"])  # the shortest, so the best ranked
    found = await text.search(db, "own", ["beach", "lighthouse"], 1, ALICE, [], False, 2)
    assert [row.id for row, _, _ in found] == [*old, *newest]


async def test_postings_are_counted_again_once_the_index_has_grown(db: Database) -> None:
    await add_rows(db, ["an otter", "a heron"])
    assert await _counts(db, ["otter", "heron"]) == (2, [1, 1])
    await add_rows(db, ["another otter"])
    assert await _counts(db, ["otter", "heron"]) == (3, [2, 1])


@pytest.mark.parametrize("index", [text.OWN_TEXT, text.CONTEXT_KEYS], ids=["own", "context"])
async def test_an_owners_rows_are_counted_from_an_index_alone_once_vacuumed(
    db: Database, index: text.TextIndex
) -> None:
    await add_rows(db, [f"turn {i} of a long talk" for i in range(3000)], context=True)
    await assert_eventually(lambda: _all_visible_once_vacuumed(db))
    sql, values = text.counting(index, text._owned(index, ALICE), [""])
    async with text._reading(db) as reader:
        plan = "\n".join(
            r[0] for r in await reader.fetch(f"EXPLAIN (ANALYZE, COSTS OFF) {sql}", *values)
        )
        counted = (await reader.fetch(sql, *values))[0][1]
    assert counted == 3000
    # Both the newest rowid and the owner's rows read from an index, no row of the table.
    assert plan.count("Index Only Scan") == plan.count("Heap Fetches: 0") == 2, plan


async def _all_visible_once_vacuumed(db: Database) -> bool:
    """Vacuums both tables; whether every page of theirs is then marked all-visible. A
    transaction that began before the rows were written and still runs (autovacuum analysing
    the new table, say) keeps a vacuum from marking them: the next one, once it ends, does."""
    await db.execute("VACUUM (ANALYZE) memories, memory_keys")
    rows = await db.fetch(
        "SELECT relpages, relallvisible FROM pg_class "
        "WHERE relname IN ('memories', 'memory_keys') AND relkind = 'r'"
    )
    return len(rows) == 2 and all(pages == visible for pages, visible in rows)


async def test_a_common_terms_postings_beyond_the_budget_are_estimated_from_the_newest(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keywords, "POSTING_BUDGET", 10)
    await add_rows(db, ["a heron"] * 30 + ["an otter", "a heron"] * 5)
    rows, (otter, heron) = await _counts(db, ["otter", "heron"])
    # Half of the newest ten hold "heron": half of the 40 rows are taken to.
    assert (rows, otter, heron) == (40, 5, 20)


async def _counts(db: Database, terms: list[str]) -> tuple[int, list[int]]:
    owned = text._owned(text.OWN_TEXT, ALICE)
    async with text._reading(db) as reader:
        return await text.POSTINGS.count(reader, text.OWN_TEXT, owned, terms)
