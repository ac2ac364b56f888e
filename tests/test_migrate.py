"""`hyatlas migrate`: a SQLite store moved into a PostgreSQL one through export and import."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.store_state import LONG_TEXT, call, export, seed
from tests.support import ROOT, Stack, running_stack

pytestmark = pytest.mark.slow


@pytest.fixture
def source(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    with running_stack(
        tmp_path_factory.mktemp("migrate-sqlite"),
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_ADMIN="on",
    ) as stack:
        yield stack


@pytest.fixture
def target(
    tmp_path_factory: pytest.TempPathFactory, embedder_address: str, pg_databases: Any
) -> Iterator[Stack]:
    with running_stack(
        tmp_path_factory.mktemp("migrate-postgres"),
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_STORE_DSN=pg_databases.new_dsn(),
        HYATLAS_ADMIN="on",  # for the test's export of every owner
    ) as stack:
        yield stack


async def _migrate(source: Stack, target: Stack) -> dict[str, Any]:
    """Runs the command as a user would; its printed reply."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "hyatlas_cli", "--url", source.base_url, "migrate", "--to",
         target.base_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "migrate" in done.stderr  # the progress bar
    reply: dict[str, Any] = json.loads(done.stdout)
    return reply


async def _search(stack: Stack, user: str, query: str) -> list[str]:
    status, body = await call(
        stack, "POST", "/api/v1/search", json={"query": query, "user_id": user, "limit": 10}
    )
    assert status == 200, body
    return [m["memory_id"] for items in body["memories"].values() for m in items]


async def test_migrate_moves_every_owner_into_postgresql_and_again_adds_nothing(
    source: Stack, target: Stack
) -> None:
    users = [f"user-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    seeded = {user: await seed(source, user) for user in users}
    lines = (await export(source))[1:]
    assert {line["memory"]["user_id"] for line in lines if line["type"] == "memory"} == set(users)
    assert any(line["memory"]["status"] == "retired" for line in lines if "memory" in line)

    reply = await _migrate(source, target)
    assert reply == {
        "lines": len(lines),
        "imported": len(lines),
        "skipped": 0,
        "refused": 0,
        "errors": [],
    }
    # Every row with its vector, keys and history, and every edge, in the same order.
    assert (await export(target))[1:] == lines
    for user in users:
        long_turn = next(
            line["memory"]["id"]
            for line in lines
            if line["type"] == "memory"
            and line["memory"]["user_id"] == user
            and line["memory"]["content"] == LONG_TEXT
        )
        assert long_turn in await _search(target, user, "farmhouse roof")
        assert seeded[user]["l3_fact"] in await _search(target, user, "favourite tea")
        status, history = await call(
            target, "GET", "/api/v1/history",
            params={"user_id": user, "id": seeded[user]["restored"]},
        )
        assert status == 200, history
        assert [e["action"] for e in history["history"]] == ["insert", "retire", "restore"]

    again = await _migrate(source, target)
    assert (again["imported"], again["skipped"], again["refused"]) == (0, len(lines), 0)
    assert (await export(target))[1:] == lines
