"""The plugin's outbox past the server's idempotency window, and its bound, against a real stack."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.support import Stack, free_port, running_stack, serving_http
from tests.test_plugin_hermes import (
    drive,
    drive_async,
    gateway,
    hermes_cli,
    hermes_python,
    make_home,
)

pytestmark = pytest.mark.slow

__all__ = ["hermes_python"]  # a fixture this module's tests use

DAY_S = 24 * 3600.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    """store + gateway in lite mode, shared by this module (each test has its own user)."""
    with running_stack(tmp_path_factory.mktemp("plugin-outbox"), ["store", "gateway"],
                       HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_MODE="lite") as s:
        yield s


def _turn(user: str, text: str) -> dict[str, Any]:
    return {"text": text, "user_id": user, "agent_id": "hermes", "session_id": "s-1",
            "metadata": {"write_origin": "sync_turn", "source": "hermes"}}


def _stored(stack: Stack, user: str) -> list[str]:
    listed = gateway(stack, "POST", "/api/v1/list", {"user_id": user, "limit": 1000})
    return [m["content"] for m in listed["memories"]]


def gateway_add(stack: Stack, payload: dict[str, Any], key: str) -> dict[str, Any]:
    """One add with an Idempotency-Key, as the outbox's first try sends it."""
    req = urllib.request.Request(
        stack.base_url + "/api/v1/add", method="POST", data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
    )
    with urllib.request.urlopen(req, timeout=10) as reply:
        return dict(json.loads(reply.read()))

def _server_forgets_key(stack: Stack, key: str) -> None:
    """Ages the key's record two days, as if the write had been stored two days ago: past
    the server's window, so it no longer knows the key."""
    with contextlib.closing(sqlite3.connect(stack.data_dir / "hyatlas.db")) as db, db:
        changed = db.execute(
            "UPDATE idempotency_keys SET created_at = created_at - ? WHERE key = ?",
            (2 * DAY_S, key),
        ).rowcount
    assert changed == 1


def test_a_write_queued_past_the_key_window_that_the_server_stored_is_not_stored_twice(
    tmp_path: Path, hermes_python: Path, stack: Stack
) -> None:
    """The first try was stored but its answer was lost; two days later the outbox finds the
    write on the server and drops it instead of sending it under a key the server forgot."""
    user = f"u-{uuid.uuid4().hex[:8]}"
    key = uuid.uuid4().hex
    first = _turn(user, "USER: the boiler was serviced on Tuesday")
    status = gateway_add(stack, first, key)
    assert status["success"] is True
    _server_forgets_key(stack, key)
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id=user)
    result = drive(hermes_python, home, "aged_outbox", {
        "server_url": stack.base_url, "ops": [[first, key]], "age_s": 2 * DAY_S})
    assert result["sent"] is True and result["queued"] == []
    assert _stored(stack, user) == [first["text"]]
    assert result["dropped"] == {"already_stored": 1}
    assert any("already stored" in line for line in result["logged"]), result["logged"]
    shown = hermes_cli(hermes_python, home, "status")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["plugin_dropped"] == {"already_stored": 1}


def test_a_row_erased_while_the_outbox_looks_for_its_write_does_not_hide_the_write(
    tmp_path: Path, hermes_python: Path, stack: Stack
) -> None:
    """The stored write is the 201st newest raw row holding its text (the lookup lists those
    alone); one of the 200 newer rows is deleted on the server once the first page is read.
    The next page still starts right after that page, so the write is found and not stored
    twice."""
    user = f"u-{uuid.uuid4().hex[:8]}"
    key = uuid.uuid4().hex
    first = _turn(user, "USER: the piano was tuned in March")
    assert gateway_add(stack, first, key)["success"] is True
    _server_forgets_key(stack, key)
    newer = [gateway_add(stack, _turn(user, f"USER: the piano was tuned in March, note {i}"),
                         uuid.uuid4().hex)
             for i in range(200)]
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id=user)
    result = drive(hermes_python, home, "aged_outbox", {
        "server_url": stack.base_url, "ops": [[first, key]], "age_s": 2 * DAY_S,
        "erase_after_first_page": [newer[-1]["memory_id"]]})
    assert result["sent"] is True and result["queued"] == []
    assert result["dropped"] == {"already_stored": 1}
    assert _stored(stack, user).count(first["text"]) == 1


def test_a_write_queued_past_the_key_window_that_the_server_lacks_is_sent(
    tmp_path: Path, hermes_python: Path, stack: Stack
) -> None:
    """The same lookup finds neither the text in another session nor another text: both
    writes are sent, and nothing is counted as dropped."""
    user = f"u-{uuid.uuid4().hex[:8]}"
    gateway(stack, "POST", "/api/v1/add",
            {**_turn(user, "USER: the bins go out on Monday"), "session_id": "s-other"})
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id=user)
    ops = [[_turn(user, "USER: the bins go out on Monday"), uuid.uuid4().hex],
           [_turn(user, "USER: the car is due for its MOT"), uuid.uuid4().hex]]
    result = drive(hermes_python, home, "aged_outbox", {
        "server_url": stack.base_url, "ops": ops, "age_s": 2 * DAY_S})
    assert result["sent"] is True and result["queued"] == []
    assert sorted(_stored(stack, user)) == sorted(
        ["USER: the bins go out on Monday"] * 2 + ["USER: the car is due for its MOT"])
    assert result["dropped"] == {}


WRITER = "writer-secret-0123456789"


@pytest.fixture(scope="module")
def token_stack(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    """A lite stack whose one token may write but not read."""
    folder = tmp_path_factory.mktemp("plugin-outbox-tokens")
    tokens = folder / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"name": "writer", "token": WRITER, "users": ["*"],
                                              "agents": ["*"], "scopes": ["write"]}]}))
    with running_stack(folder / "stack", ["store", "gateway"], HYATLAS_MODE="lite",
                       HYATLAS_EMBEDDER_ADDR=embedder_address,
                       HYATLAS_TOKENS_FILE=str(tokens)) as s:
        yield s


def test_a_write_queued_past_the_key_window_is_sent_when_the_token_may_not_look(
    tmp_path: Path, hermes_python: Path, token_stack: Stack
) -> None:
    """A token that may write but not list cannot check the server: the write is sent again
    (it may be stored twice), not refused for good because the lookup was."""
    user = f"u-{uuid.uuid4().hex[:8]}"
    home = make_home(tmp_path, hermes_python, server_url=token_stack.base_url, user_id=user)
    result = drive(hermes_python, home, "aged_outbox", {
        "server_url": token_stack.base_url, "token": WRITER, "age_s": 2 * DAY_S,
        "ops": [[_turn(user, "USER: the gutters were cleared"), uuid.uuid4().hex]]})
    assert result["sent"] is True and result["queued"] == [] and result["dropped"] == {}
    assert any("sent again unchecked" in line for line in result["logged"]), result["logged"]
    with contextlib.closing(sqlite3.connect(token_stack.data_dir / "hyatlas.db")) as db:
        stored = db.execute("SELECT content FROM memories WHERE user_id = ?", (user,)).fetchall()
    assert stored == [("USER: the gutters were cleared",)]


async def test_an_outbox_closed_while_a_send_waits_records_the_answer_that_comes_after(
    tmp_path: Path, hermes_python: Path
) -> None:
    """Hermes shuts the provider down while the server has not answered an add yet: the sender
    still records the answer (the op leaves the queue), instead of failing on a closed
    database and keeping an op the server took."""
    seen: list[str] = []
    released = asyncio.Event()

    async def add(request: web.Request) -> web.Response:
        seen.append((await request.json())["text"])
        await released.wait()
        return web.json_response({"success": True, "memory_id": "m-closed"})

    async def count(request: web.Request) -> web.Response:
        return web.json_response({"seen": len(seen)})

    async def release(request: web.Request) -> web.Response:
        released.set()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/api/v1/add", add)
    app.router.add_get("/seen", count)
    app.router.add_post("/release", release)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url, user_id="u-closed")
        result = await drive_async(hermes_python, home, "closed_mid_send", {"server_url": url})
    assert seen == ["USER: the gate code is 1942"]
    assert result["pending"] == 0
    assert not any("sender failed" in line for line in result["logged"]), result["logged"]


def test_a_full_outbox_drops_its_oldest_writes_and_says_how_many(
    tmp_path: Path, hermes_python: Path
) -> None:
    home = make_home(tmp_path, hermes_python, server_url=f"http://127.0.0.1:{free_port()}",
                     user_id="u-full")
    ops: list[list[Any]] = [[_turn("u-full", f"USER: note {i}"), uuid.uuid4().hex]
                            for i in range(5)]
    ops.insert(1, [{**_turn("u-full", "note 0"), "source": "memory_tool", "target": "memory"},
                   uuid.uuid4().hex, "forget"])
    result = drive(hermes_python, home, "aged_outbox", {
        "server_url": f"http://127.0.0.1:{free_port()}", "ops": ops, "age_s": 0,
        "max_ops": 3, "send": False})
    assert result["queued"] == ["USER: note 2", "USER: note 3", "USER: note 4"]
    assert result["dropped"] == {"over_limit": 3}
    # What was dropped, by kind: a lost forget leaves a memory live on the server.
    dropped = [line for line in result["logged"] if "oldest were dropped" in line]
    assert [line.split("unsent ")[1] for line in dropped] == [
        "(1 add)", "(1 forget)", "(1 add)"]

