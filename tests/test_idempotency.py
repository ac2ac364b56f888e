"""Idempotency-Key on /api/v1/add through the running stack, and the plugin's outbox sending one."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support import Stack, running_stack, serving_http
from tests.test_plugin_hermes import GATEWAY_READY, hermes_cli, hermes_python, make_home

pytestmark = pytest.mark.slow

__all__ = ["hermes_python"]  # a fixture this module's plugin test uses


@pytest.fixture(scope="module")
def stack(
    store_backend: str,
    tmp_path_factory: pytest.TempPathFactory,
    embedder_address: str,
) -> Iterator[Stack]:
    """store + gateway in lite mode, shared by this module (each test has its own user)."""
    with running_stack(
        tmp_path_factory.mktemp("idempotency"), ["store", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
    ) as s:
        yield s


async def add(stack: Stack, body: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            stack.base_url + "/api/v1/add", json=body, headers={"Idempotency-Key": key}
        ) as reply,
    ):
        return reply.status, await reply.json()


async def stored(stack: Stack, user: str) -> list[tuple[str, str]]:
    """(id, text) of every row the user has."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            stack.base_url + "/api/v1/list", json={"user_id": user, "limit": 1000}
        ) as reply,
    ):
        assert reply.status == 200
        body = await reply.json()
    return [(m["memory_id"], m["content"]) for m in body["memories"]]


def _user() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


async def test_an_add_sent_twice_with_one_key_is_stored_once_and_both_answers_carry_its_id(
    stack: Stack,
) -> None:
    user, key = _user(), uuid.uuid4().hex
    body = {"text": "The spare key is under the blue pot", "user_id": user}
    first = await add(stack, body, key)
    again = await add(stack, body, key)
    assert first[0] == again[0] == 200, (first, again)
    assert again[1]["memory_id"] == first[1]["memory_id"]
    assert again[1]["replayed"] is True and "replayed" not in first[1]
    assert await stored(stack, user) == [(first[1]["memory_id"], body["text"])]


async def test_one_key_sent_many_times_at_once_stores_one_row(stack: Stack) -> None:
    user, key = _user(), uuid.uuid4().hex
    body = {"text": "Gate code is 4471", "user_id": user}
    replies = await asyncio.gather(*(add(stack, body, key) for _ in range(8)))
    assert {status for status, _ in replies} == {200}, replies
    ids = {reply["memory_id"] for _, reply in replies}
    assert len(ids) == 1
    assert await stored(stack, user) == [(ids.pop(), body["text"])]


async def test_a_key_used_again_with_another_body_is_refused_and_stores_nothing(
    stack: Stack,
) -> None:
    user, key = _user(), uuid.uuid4().hex
    first = await add(stack, {"text": "Dentist on Tuesday", "user_id": user}, key)
    assert first[0] == 200, first
    status, body = await add(stack, {"text": "Dentist on Friday", "user_id": user}, key)
    assert status == 409, body
    assert "Idempotency-Key" in body["error"] and body["success"] is False
    assert await stored(stack, user) == [(first[1]["memory_id"], "Dentist on Tuesday")]


async def test_a_key_is_per_owner_so_another_user_may_use_the_same_one(stack: Stack) -> None:
    key = uuid.uuid4().hex
    alice, bob = _user(), _user()
    one = await add(stack, {"text": "Likes green tea", "user_id": alice}, key)
    two = await add(stack, {"text": "Likes green tea", "user_id": bob}, key)
    assert one[0] == two[0] == 200
    assert one[1]["memory_id"] != two[1]["memory_id"]
    assert [text for _, text in await stored(stack, bob)] == ["Likes green tea"]


async def test_an_unusable_key_is_refused_with_400_and_stores_nothing(stack: Stack) -> None:
    user = _user()
    for key in ("k" * 256, "caf\u00e9"):
        status, body = await add(stack, {"text": "Should not be kept", "user_id": user}, key)
        assert status == 400, body
        assert "Idempotency-Key" in body["error"]
    assert await stored(stack, user) == []


async def test_the_plugin_sends_a_queued_add_again_with_the_key_of_its_first_try(
    tmp_path: Path, hermes_python: Path
) -> None:
    """The first try meets a busy server (503); the CLI queues the note, and the outbox sends it
    again when the server is back, with the same key and body."""
    seen: list[tuple[str, dict[str, Any]]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.headers.get("Idempotency-Key", ""), await request.json()))
        if len(seen) == 1:
            return web.json_response(
                {"error": "server busy", "success": False}, status=503,
                headers={"Retry-After": "1"},
            )
        return web.json_response({"success": True, "memory_id": "m1"})

    async def ready(request: web.Request) -> web.Response:
        return web.json_response(GATEWAY_READY)

    app = web.Application()
    app.router.add_post("/api/v1/add", record)
    app.router.add_get("/readyz", ready)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url,
                         user_id="u-key")
        queued = await asyncio.to_thread(
            hermes_cli, hermes_python, home, "add", "Bins", "go", "out", "on", "Monday"
        )
        assert queued.returncode == 0, queued.stderr
        assert json.loads(queued.stdout)["queued"] is True
        sent = await asyncio.to_thread(hermes_cli, hermes_python, home, "start")
        assert sent.returncode == 0, sent.stderr
        assert "queued writes sent; 0 still waiting" in sent.stdout
    assert len(seen) == 2
    (first_key, first_body), (second_key, second_body) = seen
    assert first_key and first_key == second_key
    assert first_body == second_body and first_body["text"] == "Bins go out on Monday"
