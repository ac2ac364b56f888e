"""`hyatlas migrate`: a SQLite store moved into a PostgreSQL one through export and import."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import asyncpg
import numpy as np
import pytest
from aiohttp import web

from services.embedder.derive import derive_fp16
from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from tests.store_state import LONG_TEXT, apply, call, export, seed, vector_line
from tests.support import ROOT, Stack, assert_eventually, running_stack, serving_http

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


def _vectors_apart(lines: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Export lines with their vectors taken out, and those vectors in order."""
    bare, vectors = json.loads(json.dumps(lines)), []
    for line in bare:
        for holder in [line, *line.get("keys", [])]:
            if holder.get("vector"):
                vectors.append(np.frombuffer(base64.b64decode(holder.pop("vector")), "<f4"))
    return bare, np.array(vectors)


def _assert_same(moved: list[dict[str, Any]], lines: list[dict[str, Any]]) -> None:
    """The same lines, vectors up to PostgreSQL's half precision (SQLite keeps 8 bits a
    component with its own scale; a half-precision value is within 1/2048 of it)."""
    moved_bare, moved_vectors = _vectors_apart(moved)
    bare, vectors = _vectors_apart(lines)
    assert moved_bare == bare
    assert moved_vectors.shape == vectors.shape and len(vectors) > 0
    np.testing.assert_allclose(moved_vectors, vectors, rtol=1 / 2048, atol=1e-7)


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
    lines = (await export(source))[1:-1]
    assert {line["memory"]["user_id"] for line in lines if line["type"] == "memory"} == set(users)
    assert any(line["memory"]["status"] == "retired" for line in lines if "memory" in line)

    reply = await _migrate(source, target)
    assert reply == {
        "lines": len(lines),
        "imported": len(lines),
        "skipped": 0,
        "updated": 0,
        "erased": 0,
        "refused": 0,
        "errors": [],
        "stopped": False,
        "complete": True,
    }
    # Every row with its vector, keys and history, and every edge, in the same order.
    _assert_same(((await export(target))[1:-1]), lines)
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
    assert (again["imported"], again["skipped"], again["updated"], again["refused"]) == (
        0, len(lines), 0, 0)
    _assert_same(((await export(target))[1:-1]), lines)


async def _ok(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, reply = await call(stack, "POST", path, json=body)
    assert status == 200, reply
    return dict(reply)


async def test_a_second_migrate_carries_forgets_edits_restores_and_deletes_made_since_the_first(
    source: Stack, target: Stack
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    seeded = await seed(source, user)
    turns = await _ok(source, "/api/v1/list", {"user_id": user, "layer": "l2_raw"})
    # An edge a consolidation pass wrote, to be undone with it.
    await apply(source, user, store_pb2.Op(put_edge=store_pb2.PutEdgeOp(
        owner=common_pb2.Owner(user_id=user), subject="user", relation="visits",
        object="dentist", source_ids=[m["memory_id"] for m in turns["memories"][:2]],
        fact_ids=[seeded["l3_fact"]], pass_id=f"pass-{user}",
    )))
    first = await _migrate(source, target)
    assert (first["imported"], first["refused"]) == (len(await export(source)) - 2, 0)
    older = await export(source)

    # Writes on the old server between the two runs, of every kind that changes a row.
    forgot = await _ok(source, "/api/v1/forget", {"user_id": user, "id": seeded["l3_fact"]})
    assert forgot["forgotten"] >= 1
    edited = await _ok(source, "/api/v1/update", {
        "user_id": user, "id": seeded["dentist_turn"],
        "text": "I had a dentist appointment on Wednesday.",
    })
    # The row the forgotten fact replaced can come back now.
    restored = await _ok(source, "/api/v1/restore", {"user_id": user, "id": seeded["retired"]})
    assert restored["restored"] is True
    long_turn = next(
        line["memory"]["id"] for line in older[1:-1]
        if line["type"] == "memory" and line["memory"]["content"] == LONG_TEXT
    )
    await _ok(source, "/api/v1/delete_all", {"user_id": user, "id": long_turn})
    async with open_channel(source.address("store")) as channel:
        await store_pb2_grpc.StoreStub(channel).UndoPass(
            store_pb2.UndoPassRequest(pass_id=f"pass-{user}", actor="api"), timeout=60
        )
    added = await _ok(source, "/api/v1/add", {
        "text": "I started learning the cello in May.", "user_id": user, "session_id": "s2",
    })
    lines = (await export(source))[1:-1]
    assert long_turn not in {line["memory"]["id"] for line in lines if "memory" in line}

    again = await _migrate(source, target)
    _assert_same((await export(target))[1:-1], lines)
    assert long_turn not in await _search(target, user, "farmhouse roof")
    assert seeded["l3_fact"] not in await _search(target, user, "favourite tea")
    assert edited["memory_id"] in await _search(target, user, "dentist appointment")
    assert added["memory_id"] in await _search(target, user, "cello")
    # The edit's new version and the new turn are new rows; the forgotten, edited and restored
    # rows (and the turns beside the deleted one, their context keys) are replaced.
    assert again["imported"] >= 2 and again["updated"] >= 3, again
    assert (again["erased"], again["refused"]) == (2, 0), again
    assert again["lines"] == len(lines) + 2  # the gone lines of the deleted turn, the undone edge

    # The deleted turn's history answers on both, as ids, times and states with the delete last.
    for stack in (source, target):
        status, history = await call(stack, "GET", "/api/v1/history",
                                     params={"user_id": user, "id": long_turn})
        assert status == 200, history
        assert history["history"][-1]["action"] == "delete", history
        assert LONG_TEXT not in json.dumps(history), history

    # Once more changes nothing.
    third = await _migrate(source, target)
    assert (third["imported"], third["updated"], third["erased"]) == (0, 0, 0), third
    # The older export imported without sync rolls no row back: it adds the one it holds that
    # the store does not (the deleted turn), as any import does, and skips the rest.
    status, reply = await call(
        target, "POST", "/api/v1/import",
        data="".join(json.dumps(line) + "\n" for line in older).encode(),
    )
    # (The undone edge is kept hidden, and skipped, as on the old server.)
    assert status == 200 and (reply["imported"], reply["skipped"]) == (1, len(older) - 3), reply
    assert "updated" not in reply
    moved = [line for line in (await export(target))[1:-1]
             if line.get("memory", {}).get("id") != long_turn]
    _assert_same(moved, lines)


async def test_a_server_on_postgresql_says_it_takes_no_snapshots_and_counts_its_database(
    target: Stack,
) -> None:
    status, reply = await call(target, "POST", "/api/v1/admin/snapshot")
    assert status == 501 and "pg_dump" in reply["error"], reply
    status, system = await call(target, "GET", "/dashboard/api/system")
    assert status == 200 and system["store_backend"] == "postgresql"
    # Its size on disk counts the database that holds the rows (the data dir holds sockets);
    # the database may grow a little between the two reads.
    conn = await asyncpg.connect(target.env["HYATLAS_STORE_DSN"])
    try:
        database = await conn.fetchval("SELECT pg_database_size(current_database())")
    finally:
        await conn.close()
    assert system["data_bytes"] >= database * 0.9, (system["data_bytes"], database)
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "hyatlas_cli", "--url", target.base_url, "doctor"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert "ok   snapshots: not taken on PostgreSQL" in done.stdout, done.stdout


async def test_a_postgresql_store_moves_to_another_model_by_a_migrate_into_a_new_database(
    tmp_path_factory: pytest.TempPathFactory, target: Stack, pg_databases: Any
) -> None:
    """A re-embed is not built on PostgreSQL: a store whose embedder now runs another model
    says how to move instead, and that way (a new database, `hyatlas migrate`) gives every
    row and key a vector of the new model."""
    user = f"user-{uuid.uuid4().hex[:8]}"
    await seed(target, user)
    lines = [line for line in (await export(target))[1:] if line["type"] == "memory"]
    fp16 = derive_fp16(tmp_path_factory.mktemp("fp16"))
    with running_stack(
        tmp_path_factory.mktemp("migrate-fp16"),
        ["embedder", "store", "search", "gateway"],
        HYATLAS_MODEL_DIR=str(fp16),
        HYATLAS_STORE_DSN=pg_databases.new_dsn(),
        HYATLAS_ADMIN="on",
    ) as moved:
        with running_stack(
            tmp_path_factory.mktemp("migrate-old-db-new-model"),
            ["store", "gateway"],
            HYATLAS_EMBEDDER_ADDR=moved.address("embedder"),
            HYATLAS_STORE_DSN=target.env["HYATLAS_STORE_DSN"],
        ) as mismatched:
            status, body = await call(mismatched, "POST", "/api/v1/add",
                                      json={"text": "one more", "user_id": user})
            assert status == 409 and "hyatlas migrate" in body["error"], body

        reply = await _migrate(target, moved)
        assert (reply["imported"], reply["refused"]) == (len(await export(target)) - 2, 0)
        moved_lines = [line for line in (await export(moved))[1:] if line["type"] == "memory"]
        assert [line["memory"]["id"] for line in moved_lines] == [
            line["memory"]["id"] for line in lines]
        model = (await export(moved))[0]["model_id"]
        assert model == "all-MiniLM-L6-v2-fp16" and lines[0]["model_id"] != model
        assert {line["model_id"] for line in moved_lines} == {model}
        keys = [key for line in moved_lines for key in line.get("keys", []) if key["vector"]]
        assert keys  # the clause and context keys were embedded again, not dropped
        long_turn = next(line["memory"]["id"] for line in lines
                         if line["memory"]["content"] == LONG_TEXT)
        assert long_turn in await _search(moved, user, "farmhouse roof")


# Rows enough for three import batches of 500 (the gateway's BATCH_LINES), and where the
# held export stops: two batches read, so the first is written while the second waits.
HELD_ROWS = 1_200
HELD_AT = 1_100


@contextlib.asynccontextmanager
async def _held_after(
    source: Stack, lines: int
) -> AsyncIterator[tuple[str, asyncio.Event, asyncio.Event]]:
    """A link to source's gateway whose export stops after its first lines and stays open (a
    server or network stuck mid-way): its URL, an event set once it holds, and one to set to
    end the export there."""
    held, released = asyncio.Event(), asyncio.Event()

    async def forward(request: web.Request) -> web.StreamResponse:
        async with (
            aiohttp.ClientSession() as session,
            session.get(source.base_url + request.path_qs) as answer,
        ):
            if request.path != "/api/v1/export":
                return web.Response(status=answer.status, body=await answer.read(),
                                    content_type=answer.content_type)
            reply = web.StreamResponse()
            await reply.prepare(request)
            for _ in range(lines):
                await reply.write(await answer.content.readline())
            held.set()
            await released.wait()
            return reply

    app = web.Application()
    app.router.add_get("/{tail:.*}", forward)
    async with serving_http(app) as url:
        try:
            yield url, held, released
        finally:
            released.set()


@pytest.mark.parametrize("cut", ["the command killed", "the target's store stopped"])
async def test_a_sync_migrate_cut_short_and_run_again_leaves_every_line_once(
    source: Stack, target: Stack, cut: str
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    model = (await export(source, user_id="nobody"))[0]["model_id"]
    status, reply = await call(source, "POST", "/api/v1/import", data=io.BytesIO("".join(
        vector_line(user, n, model) + "\n" for n in range(HELD_ROWS)).encode()))
    assert status == 200 and reply["imported"] == HELD_ROWS, reply
    assert (await _migrate(source, target))["imported"] == HELD_ROWS
    # Changes in the first batch, the second, the third, and rows deleted for good.
    for n in (10, 700, 1_150):
        await _ok(source, "/api/v1/update",
                  {"user_id": user, "id": f"{user}-{n:04d}", "text": f"Rowing log {n}: rest."})
    for n in (20, 1_100):
        await _ok(source, "/api/v1/delete_all", {"user_id": user, "id": f"{user}-{n:04d}"})

    async with _held_after(source, HELD_AT) as (url, held, released):
        migrating = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hyatlas_cli", "--url", url, "migrate", "--to",
            target.base_url, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await held.wait()

            async def first_batch_written() -> None:
                status, history = await call(target, "GET", "/api/v1/history",
                                             params={"user_id": user, "id": f"{user}-0010"})
                assert status == 200 and history["history"][-1]["action"] != "insert", history

            await assert_eventually(first_batch_written)
            if cut == "the target's store stopped":
                await asyncio.to_thread(target.procs["store"].stop)
                released.set()  # the rest of the export: the second batch meets no store
                _, err = await migrating.communicate()
                assert migrating.returncode == 2, err
                assert "HTTP 503" in err.decode().splitlines()[-1], err
                await asyncio.to_thread(target.start, "store")

                async def ready() -> None:
                    status, body = await call(target, "GET", "/readyz")
                    assert status == 200, body

                await assert_eventually(ready)  # the gateway's channel is back
        finally:
            if migrating.returncode is None:
                migrating.kill()
                await migrating.communicate()

    if cut == "the command killed":
        # The target writes the lines it read (the first two batches whole) once the client
        # is gone.
        log = target.data_dir / "gateway.log"

        def settled() -> None:
            assert "POST /api/v1/import: the client went away" in log.read_text()

        await assert_eventually(settled)
    # Cut mid-way: the third batch's change and the deletes did not come.
    held_rows = {line["memory"]["id"]: line["memory"]["status"]
                 for line in (await export(target, user_id=user))[1:-1]}
    assert len(held_rows) == HELD_ROWS and held_rows[f"{user}-0010"] == "retired"
    assert held_rows[f"{user}-0700"] == ("retired" if cut == "the command killed" else "active")
    assert held_rows[f"{user}-1150"] == "active", held_rows

    again = await _migrate(source, target)
    assert (again["imported"], again["erased"], again["refused"]) == (3, 2, 0), again
    lines = (await export(source))[1:-1]
    moved = (await export(target))[1:-1]
    _assert_same(moved, lines)
    ids = [line["memory"]["id"] for line in moved if line["type"] == "memory"]
    assert len(ids) == len(set(ids)) == HELD_ROWS + 3 - 2
