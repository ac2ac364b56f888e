"""Two nodes on one PostgreSQL database: each runs its own store, search and gateway processes;
writers and imports on both, a kill -9 of one node's store, and every acknowledged write
found once."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support import Stack, assert_eventually, running_stack, value_eventually

pytestmark = pytest.mark.slow

USER = "team"
WORDS = ["harbour", "lantern", "orchid", "granite", "violin", "meadow", "comet", "saffron"]


@contextlib.contextmanager
def two_nodes(root: Path, dsn: str, embedder_address: str) -> Iterator[tuple[Stack, Stack]]:
    """Node a and node b: store, search and gateway each, sharing the database at dsn."""
    with contextlib.ExitStack() as nodes:
        a, b = (
            nodes.enter_context(
                running_stack(
                    root / name,
                    ["store", "search", "gateway"],
                    HYATLAS_EMBEDDER_ADDR=embedder_address,
                    HYATLAS_STORE_DSN=dsn,
                )
            )
            for name in ("a", "b")
        )
        yield a, b


def text_of(writer: str, n: int) -> str:
    """A distinct text per write (no two alike enough to be taken for one another)."""
    first, second = WORDS[n % len(WORDS)], WORDS[(n * 3 + len(writer)) % len(WORDS)]
    return f"Note {n} of {writer}: the {first} by the {second} is numbered {n * 7919 % 10007}."


async def add(session: aiohttp.ClientSession, node: Stack, text: str) -> str | None:
    """The new id if the node acknowledged the write; None if it refused it."""
    try:
        async with session.post(
            node.base_url + "/api/v1/add", json={"text": text, "user_id": USER}
        ) as reply:
            body = await reply.json()
            return str(body["memory_id"]) if reply.status == 200 else None
    except aiohttp.ClientError:
        return None


async def writer(node: Stack, name: str, count: int, acked: dict[str, str]) -> None:
    """Adds count texts one after another through node, noting each acknowledged one; stops at
    the first write the node refuses."""
    async with aiohttp.ClientSession() as session:
        for n in range(count):
            text = text_of(name, n)
            memory_id = await add(session, node, text)
            if memory_id is None:
                return
            acked[memory_id] = text


async def listed(node: Stack) -> list[dict[str, Any]]:
    """Every row of the user, retired ones included, through node's gateway."""
    rows: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session:
        for offset in itertools.count(0, 1000):
            async with session.post(
                node.base_url + "/api/v1/list",
                json={"user_id": USER, "limit": 1000, "offset": offset,
                      "include_superseded": True},
            ) as reply:
                assert reply.status == 200, await reply.text()
                page = await reply.json()
            rows += page["memories"]
            if offset + 1000 >= page["total"]:
                return rows
    raise AssertionError("unreachable")


async def search_ids(node: Stack, query: str) -> list[str]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            node.base_url + "/api/v1/search", json={"query": query, "user_id": USER, "limit": 10}
        ) as reply,
    ):
        assert reply.status == 200, await reply.text()
        body = await reply.json()
    return [hit["memory_id"] for hits in body["memories"].values() for hit in hits]


def assert_each_once(rows: list[dict[str, Any]], acked: dict[str, str]) -> None:
    counts = Counter(row["memory_id"] for row in rows)
    assert [memory_id for memory_id, n in counts.items() if n > 1] == []
    missing = set(acked) - set(counts)
    assert missing == set(), f"{len(missing)} acknowledged writes are missing"
    texts = {row["memory_id"]: row["content"] for row in rows}
    assert all(texts[memory_id] == text for memory_id, text in acked.items())


async def test_two_nodes_write_concurrently_and_agree(
    tmp_path: Path, embedder_address: str, pg_databases: Any
) -> None:
    with two_nodes(tmp_path, pg_databases.new_dsn(), embedder_address) as (a, b):
        acked: dict[str, str] = {}
        await asyncio.gather(
            *(writer(node, f"{label}{w}", 12, acked)
              for node, label in ((a, "a"), (b, "b")) for w in range(3))
        )
        assert len(acked) == 72
        rows_a, rows_b = await listed(a), await listed(b)
        assert_each_once(rows_a, acked)
        assert sorted(r["memory_id"] for r in rows_a) == sorted(r["memory_id"] for r in rows_b)
        for query in ("the lantern by the comet", "Note 5 of b1", "granite meadow"):
            assert await search_ids(a, query) == await search_ids(b, query)


def export_body(numbers: range) -> bytes:
    """An export file of memories with ids, one line each, as `/api/v1/import` reads it."""
    lines = [json.dumps({"format": "hyatlas-export", "version": 1})] + [
        json.dumps({"type": "memory", "memory": {
            "id": f"imported-{n}", "user_id": USER, "content": text_of("import", n)}})
        for n in numbers
    ]
    return ("\n".join(lines) + "\n").encode()


async def import_through(node: Stack, body: bytes) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            node.base_url + "/api/v1/import",
            data=body,
            headers={"Content-Type": "application/x-ndjson"},
        ) as reply,
    ):
        assert reply.status == 200, await reply.text()
        return dict(await reply.json())


async def test_two_nodes_importing_overlapping_files_at_once_write_each_line_once(
    tmp_path: Path, embedder_address: str, pg_databases: Any
) -> None:
    with two_nodes(tmp_path, pg_databases.new_dsn(), embedder_address) as (a, b):
        # Lines 40-79 are in both files: whichever store's batch commits second finds their
        # ids held (checked inside its transaction) and skips them.
        from_a, from_b = await asyncio.gather(
            import_through(a, export_body(range(0, 80))),
            import_through(b, export_body(range(40, 120))),
        )
        assert from_a["refused"] == from_b["refused"] == 0
        assert from_a["imported"] + from_b["imported"] == 120
        assert from_a["skipped"] + from_b["skipped"] == 40
        expected = {f"imported-{n}": text_of("import", n) for n in range(120)}
        rows_a, rows_b = await listed(a), await listed(b)
        assert_each_once(rows_a, expected)
        assert len(rows_a) == 120
        assert sorted(r["memory_id"] for r in rows_a) == sorted(r["memory_id"] for r in rows_b)


async def test_kill_9_of_one_store_replica_loses_nothing_acknowledged(
    tmp_path: Path, embedder_address: str, pg_databases: Any
) -> None:
    with two_nodes(tmp_path, pg_databases.new_dsn(), embedder_address) as (a, b):
        acked: dict[str, str] = {}
        writers = [
            asyncio.create_task(writer(node, f"{label}{w}", 30, acked))
            for node, label in ((a, "a"), (b, "b")) for w in range(2)
        ]
        # Kill node a's store while all four writers are going.
        await assert_eventually(lambda: len(acked) >= 20)
        a.procs["store"].kill()
        await asyncio.gather(*writers)
        # Node b wrote all of its texts; node a's writers lost only what was refused.
        assert sum(text.startswith("Note") and " of b" in text for text in acked.values()) == 60
        assert_each_once(await listed(b), acked)
        a.start("store")
        # Node a's gateway answers 503 until its channel reconnects to the new store.
        assert_each_once(await value_eventually(lambda: listed(a)), acked)
