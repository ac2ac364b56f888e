"""The Hermes plugin inside the real hermes-agent 0.19.0: discovery, turns, memory tool, CLI,
dashboard, the gateway going away and coming back, auto start's environment."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import select
import socket
import struct
import subprocess
import termios
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.support import ROOT, Stack, free_port, running_stack, serving_http

HERMES_VENV = ROOT / ".venv-hermes"
HERMES_PY = HERMES_VENV / "bin" / "python"
DRIVE = ROOT / "tests" / "hermes" / "drive.py"
FAKE_SERVER = ROOT / "tests" / "hermes" / "fake_server.py"
INSTALLER = ROOT / "plugins" / "hyatlas" / "install.py"

pytestmark = pytest.mark.slow

GATEWAY_STATUS = {"version": "5.0.0-py", "mode": "lite", "layers": {}}
"""The least of a status answer the plugin takes for a HyAtlas gateway's."""
GATEWAY_READY = {"status": "ready", "ready": True, "services": {}}
"""A HyAtlas gateway's readiness answer when it is ready."""


@pytest.fixture(scope="session")
def hermes_python() -> Path:
    """Hermes's interpreter; `make hermes-venv` creates it once (pip install hermes-agent)."""
    stamp = HERMES_VENV / ".installed-0.19.0"
    if not stamp.exists():
        made = subprocess.run(["make", "hermes-venv"], cwd=ROOT, capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"hermes-agent==0.19.0 could not be installed:\n{made.stderr[-2000:]}")
    return HERMES_PY


def hermes_env(home: Path, **extra: str) -> dict[str, str]:
    """A clean environment for a Hermes process: no HYATLAS_* or provider keys of ours."""
    env = {k: v for k, v in os.environ.items()
           if k in ("PATH", "LANG", "LC_ALL", "TMPDIR") or k.startswith("LC_")}
    env.update(HOME=str(home.parent), HERMES_HOME=str(home), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def searching_gateway(
    search: Callable[[web.Request], Awaitable[web.Response]],
) -> web.Application:
    """A stand-in gateway in lite mode whose searches the test answers."""

    async def status(request: web.Request) -> web.Response:
        return web.json_response(GATEWAY_STATUS)

    app = web.Application()
    app.router.add_get("/api/v1/status", status)
    app.router.add_post("/api/v1/search", search)
    return app


def make_home(tmp: Path, hermes_python: Path, **settings: Any) -> Path:
    """A HERMES_HOME with the plugin installed by its installer and hyatlas the memory provider."""
    home = tmp / "hermes_home"
    subprocess.run([str(hermes_python), str(INSTALLER), "--hermes-home", str(home)],
                   check=True, capture_output=True)
    lines = ["memory:", "  provider: hyatlas", "  hyatlas:"]
    lines += [f"    {key}: {json.dumps(value)}" for key, value in settings.items()]
    lines += ["plugins:", "  enabled: [hyatlas]", ""]
    (home / "config.yaml").write_text("\n".join(lines))
    return home


def drive(hermes_python: Path, home: Path, scenario: str, params: dict[str, Any] | None = None,
          **env: str) -> dict[str, Any]:
    """Runs one tests/hermes/drive.py scenario in Hermes's interpreter; its JSON result."""
    done = subprocess.run(
        [str(hermes_python), str(DRIVE), scenario, json.dumps(params or {})],
        env=hermes_env(home, **env), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, f"{scenario} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


async def drive_async(hermes_python: Path, home: Path, scenario: str,
                      params: dict[str, Any], **env: str) -> dict[str, Any]:
    """drive() without blocking the event loop (for tests that serve HTTP themselves)."""
    proc = await asyncio.create_subprocess_exec(
        str(hermes_python), str(DRIVE), scenario, json.dumps(params),
        env=hermes_env(home, **env), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, f"{scenario} failed:\n{err.decode()[-5000:]}"
    return json.loads(out.decode().strip().splitlines()[-1])


def gateway(stack: Stack, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """One JSON call to the stack's gateway."""
    import urllib.request

    req = urllib.request.Request(
        stack.base_url + path, method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as reply:
        return json.loads(reply.read())


def contents(answer: dict[str, Any]) -> list[str]:
    """Every memory's content in a search or list answer."""
    memories = answer["memories"]
    if isinstance(memories, list):
        return [m["content"] for m in memories]
    return [m["content"] for channel in memories.values() if isinstance(channel, list)
            for m in channel]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    """store + search + extractor + gateway in lite mode, shared by this module (tests use their
    own users); the extractor serves forget."""
    with running_stack(tmp_path_factory.mktemp("plugin-stack"),
                       ["store", "search", "gateway"],
                       HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_MODE="lite") as s:
        yield s


def test_hermes_discovery_finds_and_loads_the_provider(tmp_path: Path, hermes_python: Path):
    home = make_home(tmp_path, hermes_python, server_url="http://127.0.0.1:9")
    found = drive(hermes_python, home, "discover")
    assert found["found"]["available"] is True
    assert found["name"] == "hyatlas" and found["class"] == "HyAtlasProvider"
    assert found["dir"] == str(home / "plugins" / "hyatlas")
    assert set(found["tools"]) == {"hyatlas_status", "hyatlas_search", "hyatlas_recent",
                                   "hyatlas_add", "hyatlas_forget", "hyatlas_restore"}
    secret = [f for f in found["schema"] if f.get("secret")]
    assert {f["key"]: f["env_var"] for f in secret}["llm_key"] == "HYATLAS_LLM_KEY"
    # The wizard asks the mode, offering to leave it to the server (its default answer).
    mode = next(f for f in found["schema"] if f["key"] == "mode")
    assert mode["choices"] == ["server default", "lite", "pro", "ultra"]
    assert mode["default"] == "server default"


def test_turns_driven_by_memory_manager_are_stored_and_recalled_with_dates(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    # The recall is what is checked here, not its budget (the gateway-down test checks that):
    # the scenario waits for each write and for the recall Hermes queued before the last turn,
    # so a loaded machine answers the same; the short budget stays well inside Hermes's 8 s.
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-turns",
                     prefetch_budget_s=2.0, timeout_s=60.0)
    turns = [
        ["My dog is called Biscuit and he is a beagle.", "Biscuit the beagle, noted."],
        ["I work as a marine biologist studying coral reefs.", "Coral reef research, great."],
        ["<memory-context>\nrecalled earlier\n</memory-context>\nWhat time is it?", "A" * 5000],
        ["[CONTEXT COMPACTION — REFERENCE ONLY] Earlier turns were compacted", "ok"],
    ]
    result = drive(hermes_python, home, "turns", {
        "session_id": "s-turns", "turns": turns,
        "final_query": "What is the name of my beagle dog?",
    })
    assert all(result["flushed"]), result
    assert result["ids"] == {"user_id": "u-turns", "agent_id": "default"}
    assert "HyAtlas long-term memory is active" in result["system_prompt"]
    assert "Biscuit" in result["final"]
    assert "[20" in result["final"]  # each recalled line carries its date
    listed = gateway(stack, "POST", "/api/v1/list", {"user_id": "u-turns", "limit": 50})
    stored = contents(listed)
    # Injected memory context and compaction summaries are Hermes's text, not the user's;
    # each message is capped at 4,000 characters, by its head and tail.
    assert len(stored) == 3
    assert ("USER: What time is it?\n\nASSISTANT: " + "A" * 1984
            + " … [1,033 characters left out] … " + "A" * 1983) in stored
    assert any(t.startswith("USER: My dog is called Biscuit") and "ASSISTANT: Biscuit" in t
               for t in stored)
    found = gateway(stack, "POST", "/api/v1/search",
                    {"query": "marine biologist coral reefs", "user_id": "u-turns"})
    assert any("coral reefs" in c for c in contents(found))
    assert all(m.get("session_id") == "s-turns" for m in listed["memories"])


SKILL_TURN = ('[IMPORTANT: The user has invoked the "pets" skill, indicating they want you to '
              "follow its instructions. The full skill content is loaded below.]\n\n# Pets\n"
              "Keep a list of the user's pets.\n\nThe user has provided the following "
              "instruction alongside the skill invocation: My cat is called Miso.")
"""A /pets turn as Hermes expands it for the model (its memory gets only the instruction)."""


@pytest.mark.parametrize(("first", "tool"), [
    ("My cat is called Miso.", False), (SKILL_TURN, False), ("My cat is called Miso.", True)])
def test_a_message_typed_while_hermes_works_is_stored_with_the_one_it_interrupted(
    tmp_path: Path, hermes_python: Path, stack: Stack, first: str, tool: bool
):
    # Hermes syncs no interrupted turn, though the model sees its message in the next turn
    # (merged into the next message, or before a tool call and its result), and syncs only the
    # next one's own text: the first message was lost to memory.
    user = f"u-interrupt-{len(first)}-{tool}"
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id=user)
    second = "Also, my dog is called Rex."
    result = drive(hermes_python, home, "interrupted",
                   {"first": first, "second": second, "tool": tool})
    assert result["interrupted"] is True, result
    assert (second in result["asked"]) is tool, result  # else it was merged with the first
    assert result["flushed"], result
    listed = gateway(stack, "POST", "/api/v1/list", {"user_id": user, "limit": 10})
    assert contents(listed) == [
        f"USER: My cat is called Miso.\n\n{second}\n\nASSISTANT: Noted, both."]


COMPACTED = "[CONTEXT COMPACTION — REFERENCE ONLY] Earlier turns were compacted"
"""How Hermes's compaction summary, which is not the user's text, starts."""


def test_a_message_retried_after_a_failed_turn_is_stored_once_and_a_reset_forgets_the_unsynced(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-started")
    result = drive(hermes_python, home, "started", {"steps": [
        ["start", "Book the dentist."], ["start", "Book the dentist."],  # the first one failed
        ["sync", "Book the dentist.", "Booked."],
        ["start", "My bike is red."], ["reset", "s-new"],  # /new while that turn ran
        ["start", "Hello again."], ["sync", "Hello again.", "Hi."],
        ["start", "I parked on level 3."],  # interrupted, then Hermes compacts the context
        ["start", COMPACTED], ["sync", COMPACTED, "Ok."],
        ["start", "Thanks."], ["sync", "Thanks.", "Welcome."],
    ]})
    assert result["flushed"], result
    listed = gateway(stack, "POST", "/api/v1/list", {"user_id": "u-started", "limit": 10})
    assert sorted(contents(listed)) == [
        "USER: Book the dentist.\n\nASSISTANT: Booked.", "USER: Hello again.\n\nASSISTANT: Hi.",
        "USER: I parked on level 3.\n\nThanks.\n\nASSISTANT: Welcome."]


def test_what_the_user_said_in_turns_never_synced_is_stored_when_the_session_ends(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    # A message typed, then another that interrupted it, then the session quit: Hermes syncs
    # nothing more, and both were lost to memory.
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-quit")
    result = drive(hermes_python, home, "quit_session", {"steps": [
        ["start", "Book the dentist."], ["sync", "Book the dentist.", "Booked."],
        ["start", "I parked on level 3."], ["start", "My locker code is 2231."],
    ]})
    assert result["flushed"], result
    listed = gateway(stack, "POST", "/api/v1/list", {"user_id": "u-quit", "limit": 10})
    assert sorted(contents(listed)) == [
        "USER: Book the dentist.\n\nASSISTANT: Booked.",
        "USER: I parked on level 3.\n\nMy locker code is 2231."]
    assert {m.get("session_id") for m in listed["memories"]} == {"s-quit"}


def test_messages_of_turns_never_synced_are_each_capped_on_their_own_in_the_stored_turn(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    # Capped as one at 4,000 characters, the short message between two long ones was lost.
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-joined")
    first, last = "Notes: " + "a" * 2993, "Log: " + "b" * 2995
    result = drive(hermes_python, home, "started", {"steps": [
        ["start", first], ["start", "My locker code is 2231."], ["start", last],
        ["sync", last, "Noted."],
    ]})
    assert result["flushed"], result
    listed = gateway(stack, "POST", "/api/v1/list", {"user_id": "u-joined", "limit": 10})
    assert contents(listed) == [
        f"USER: {first}\n\nMy locker code is 2231.\n\n{last}\n\nASSISTANT: Noted."]


async def test_a_long_message_keeps_its_head_and_tail_in_the_stored_turn_and_the_recall_query(
    tmp_path: Path, hermes_python: Path
):
    """A pasted log whose important line is its last: the stored turn keeps each message's
    first and last characters (4,000 at most) and says how many were left out between; the
    recall searches with the head and tail too."""
    added: list[str] = []
    queries: list[str] = []

    async def add(request: web.Request) -> web.Response:
        added.append((await request.json())["text"])
        return web.json_response({"success": True, "memory_id": f"m{len(added)}"})

    async def search(request: web.Request) -> web.Response:
        queries.append((await request.json())["query"])
        return web.json_response({"memories": {}, "order": []})

    log = "\n".join(f"12:00:{i % 60:02d} INFO step {i} ok" for i in range(900))
    pasted = f"Why does the backup fail?\n{log}\nERROR: /dev/sdb1 is full"
    app = searching_gateway(search)
    app.router.add_post("/api/v1/add", add)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url, prefetch_budget_s=6.0)
        result = await drive_async(hermes_python, home, "turns", {
            "session_id": "s-long", "turns": [[pasted, "The disk is full."]],
            "final_query": pasted})
    assert all(result["flushed"]), result
    [text] = added
    left_out = len(pasted) - (4000 - len(" … [00,000 characters left out] … "))
    assert text.startswith("USER: Why does the backup fail?\n12:00:00 INFO step 0 ok")
    assert f" … [{left_out:,} characters left out] … " in text
    assert text.endswith("ERROR: /dev/sdb1 is full\n\nASSISTANT: The disk is full.")
    assert len(text) == len("USER: \n\nASSISTANT: The disk is full.") + 4000
    assert queries and all(q.startswith("Why does the backup fail?") and
                           q.endswith("ERROR: /dev/sdb1 is full") and len(q) == 4000
                           and "left out" not in q for q in queries), queries


def test_a_turn_holding_a_lone_surrogate_or_a_nul_is_stored_with_replacement_characters(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    # A terminal's non-UTF-8 byte, read with surrogateescape, and a NUL of pasted binary text:
    # text the gateway refuses for good.
    user = b"My caf\xe9 order is a flat white\x00".decode("utf-8", "surrogateescape")
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-surrogate",
                     timeout_s=60.0)
    result = drive(hermes_python, home, "turns", {
        "session_id": "s-surrogate", "turns": [[user, "Noted."]], "final_query": "coffee order",
    })
    assert all(result["flushed"]), result
    stored = contents(gateway(stack, "POST", "/api/v1/list", {"user_id": "u-surrogate"}))
    assert stored == ["USER: My caf\ufffd order is a flat white\ufffd\n\nASSISTANT: Noted."]


def test_memory_tool_add_is_a_write_and_replace_remove_reach_the_server_as_forget(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-tool")
    result = drive(hermes_python, home, "memory_tool", {
        "session_id": "s-tool",
        "calls": [
            {"action": "add", "target": "user", "content": "Prefers tea over coffee"},
            {"action": "replace", "target": "user", "old_text": "tea over coffee",
             "content": "Prefers green tea over coffee"},
            {"action": "remove", "target": "user", "old_text": "green tea"},
        ],
    })
    assert all(r["success"] for r in result["results"])
    # replace forgets the old note, remove forgets the new one: nothing stays live, both are
    # kept retired as forgotten (restorable), and the queue is empty.
    assert contents(gateway(stack, "POST", "/api/v1/list", {"user_id": "u-tool"})) == []
    retired = gateway(stack, "POST", "/api/v1/list",
                      {"user_id": "u-tool", "include_superseded": True})["memories"]
    assert sorted((m["content"], m["superseded_how"]) for m in retired) == [
        ("Prefers green tea over coffee", "forgotten"), ("Prefers tea over coffee", "forgotten")]
    assert result["queue"] == []


@pytest.mark.parametrize("target", ["", None], ids=["empty", "none"])
def test_a_memory_tool_remove_without_a_target_forgets_only_memory_entries_as_hermes_reads_it(
    tmp_path: Path, hermes_python: Path, stack: Stack, target: str | None
):
    user_id = f"u-target-{target}"
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id=user_id)
    result = drive(hermes_python, home, "memory_writes", {"session_id": "s-target", "calls": [
        ["add", "user", "Name is Alice", {}],
        ["add", "memory", "Alice's project uses Rust", {}],
        ["remove", target, "", {"old_text": "Alice"}],
    ]})
    assert result["flushed"] is True
    # Hermes's memory tool takes a missing target for "memory": the user profile entry stays.
    assert contents(gateway(stack, "POST", "/api/v1/list", {"user_id": user_id})) == [
        "Name is Alice"]


async def test_memory_tool_mirror_sends_add_marked_memory_tool_and_forget_of_old_text(
    tmp_path: Path, hermes_python: Path
):
    seen: list[tuple[str, dict[str, Any]]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.path, await request.json()))
        if request.path == "/api/v1/forget":
            return web.json_response({"forgotten": 1, "memories": [], "evidence_ids": []})
        return web.json_response({"success": True, "memory_id": "m1"})

    app = web.Application()
    app.router.add_post("/api/v1/add", record)
    app.router.add_post("/api/v1/forget", record)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url,
                         user_id="u-rec", agent_id="a-rec")
        await drive_async(hermes_python, home, "memory_tool", {
            "session_id": "s-rec",
            "calls": [
                {"action": "add", "target": "memory", "content": "Project uses Python 3.11"},
                {"action": "replace", "target": "memory", "old_text": "Python 3.11",
                 "content": "Project uses Python 3.12"},
                {"action": "remove", "target": "memory", "old_text": "Python 3.12"},
            ],
        })
    assert [path for path, _ in seen] == [
        "/api/v1/add", "/api/v1/forget", "/api/v1/add", "/api/v1/forget"]
    first_add, first_forget = seen[0][1], seen[1][1]
    assert first_add["text"] == "Project uses Python 3.11"
    assert first_add["metadata"]["write_origin"] == "memory_tool"
    assert first_add["metadata"]["target"] == "memory"
    assert all(isinstance(v, str) for v in first_add["metadata"].values())
    assert (first_add["user_id"], first_add["agent_id"]) == ("u-rec", "a-rec")
    assert first_forget["text"] == "Python 3.11"
    assert (first_forget["user_id"], first_forget["agent_id"]) == ("u-rec", "a-rec")
    assert seen[3][1]["text"] == "Python 3.12"


async def test_a_replaces_forget_refused_by_another_service_is_still_sent_before_its_add(
    tmp_path: Path, hermes_python: Path
):
    """A 404 page that is not the gateway's (a proxy, another service at server_url while the
    server starts) keeps the forget in line: the new text is added only after the old one is
    forgotten, so the forget cannot take the new text with it."""
    delivered: list[tuple[str, str]] = []
    refused: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        if request.path == "/api/v1/forget" and not refused:
            refused.append(request.path)
            return web.Response(status=404, text="<html>Not Found</html>",
                                content_type="text/html")
        delivered.append((request.path, body["text"]))
        return web.json_response({"success": True, "memory_id": "m1", "forgotten": 1,
                                  "memories": [], "evidence_ids": []})

    app = web.Application()
    app.router.add_post("/api/v1/add", answer)
    app.router.add_post("/api/v1/forget", answer)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url, user_id="u-order")
        result = await drive_async(hermes_python, home, "mirrored_until_sent", {
            "session_id": "s-order",
            "calls": [["replace", "memory", "Likes green tea", {"old_text": "tea"}]]})
    assert refused == ["/api/v1/forget"]
    assert delivered == [("/api/v1/forget", "tea"), ("/api/v1/add", "Likes green tea")]
    assert result["queue"] == []


def test_tools_answer_json_and_forget_of_a_mere_part_of_a_note_retires_nothing(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-tools")
    answers = drive(hermes_python, home, "tool_calls", {"session_id": "s-tools", "calls": [
        ["hyatlas_add", {"text": "The wifi password is stored in the blue notebook"}],
        ["hyatlas_search", {"query": "wifi password blue notebook", "limit": 5}],
        ["hyatlas_recent", {"limit": 5}],
        ["hyatlas_recent", {"contains": "BLUE notebook"}],
        ["hyatlas_recent", {"contains": "red notebook"}],
        ["hyatlas_status", {}],
        ["hyatlas_search", {"query": "x", "layer": "l9_nope"}],
        ["hyatlas_forget", {"text": "wifi password"}],
        ["hyatlas_search", {}],
    ]})["answers"]
    added, searched, recent, holding, not_holding, status, bad_layer, forget, no_query = answers
    assert added["success"] is True
    assert any("blue notebook" in c for c in contents(searched))
    assert contents(recent) == ["The wifi password is stored in the blue notebook"]
    assert contents(holding) == contents(recent) and contents(not_holding) == []
    assert status["mode"] == "lite" and status["plugin_queue"] == 0
    assert "l9_nope" in bad_layer["error"]
    # A forget tool call matches whole values (exact or near-exact), not a part of a note;
    # when nothing matched, the closest memories come back to be forgotten by id.
    assert forget["forgotten"] == 0 and forget["memories"] == []
    assert forget["candidates"][0]["memory_id"] == added["memory_id"]
    assert "memory_id" in forget["hint"]
    assert no_query == {"error": "query is required"}


async def test_tool_arguments_of_the_wrong_shape_get_a_clear_error_and_nothing_is_sent(
    tmp_path: Path, hermes_python: Path
):
    seen: list[str] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({"forgotten": 1, "memories": [], "evidence_ids": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url, user_id="u-shapes")
        answers = (await drive_async(hermes_python, home, "tool_calls", {
            "session_id": "s-shapes", "calls": [
                ["hyatlas_forget", {"text": ["coffee"]}],
                ["hyatlas_forget", {"text": "coffee", "memory_id": "m-1"}],
                ["hyatlas_forget", {"memory_id": 42}],
                ["hyatlas_add", {"text": {"note": "x"}}],
                ["hyatlas_search", {"query": "tea", "limit": True}],
                ["hyatlas_search", {"query": "tea", "limit": 2.5}],
                ["hyatlas_search", ["tea"]],
            ]}))["answers"]
    assert answers == [
        {"error": "text must be a string, got list"},
        {"error": "give a text or a memory id, not both"},
        {"error": "memory_id must be a string, got int"},
        {"error": "text must be a string, got dict"},
        {"error": "limit must be an integer, got True"},
        {"error": "limit must be an integer, got 2.5"},
        {"error": "hyatlas_search takes a JSON object of arguments, got list"},
    ]
    assert [path for path in seen if path.startswith("/api/v1/") and path != "/api/v1/status"] == []


def test_a_memory_the_forget_tool_retired_comes_back_with_the_restore_tool(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-restore")
    answers = drive(hermes_python, home, "tool_calls", {"session_id": "s-restore", "calls": [
        ["hyatlas_add", {"text": "The dentist appointment is on the 3rd"}],
        ["hyatlas_forget", {"text": "The dentist appointment is on the 3rd"}],
        ["hyatlas_recent", {}],
    ]})["answers"]
    added, forgotten, recent = answers
    assert [m["memory_id"] for m in forgotten["memories"]] == [added["memory_id"]]
    assert contents(recent) == []
    answers = drive(hermes_python, home, "tool_calls", {"session_id": "s-restore", "calls": [
        ["hyatlas_restore", {"memory_id": added["memory_id"]}],
        ["hyatlas_recent", {}],
        ["hyatlas_restore", {}],
        ["hyatlas_restore", {"memory_id": "no-such-memory"}],
    ]})["answers"]
    restored, recent, missing, unknown = answers
    assert restored["restored"] is True
    assert contents(recent) == ["The dentist appointment is on the 3rd"]
    assert missing == {"error": "memory_id is required"}
    assert "HTTP 404" in unknown["error"]


def test_the_forget_tool_tells_the_agent_not_to_rely_on_earlier_mentions_of_what_it_forgot(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    """The value stays in the conversation the agent sees: the answer says recall no longer
    returns it and that earlier mentions are not to be relied on; a forget that forgot nothing
    says no such thing."""
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-forget-note")
    answers = drive(hermes_python, home, "tool_calls", {"session_id": "s-forget-note", "calls": [
        ["hyatlas_add", {"text": "The gate code is 4471"}],
        ["hyatlas_forget", {"text": "The gate code is 4471"}],
        ["hyatlas_search", {"query": "gate code"}],
        ["hyatlas_forget", {"text": "The gate code is 4471"}],
    ]})["answers"]
    added, forgot, searched, again = answers
    assert [m["memory_id"] for m in forgot["memories"]] == [added["memory_id"]]
    assert forgot["note"] == ("forgotten: recall no longer returns it; do not rely on earlier "
                              "mentions of it in this conversation")
    assert contents(searched) == []
    assert again["forgotten"] == 0 and "note" not in again, again


def test_recent_tool_reads_include_raw_given_as_a_word(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-raw")
    answers = drive(hermes_python, home, "tool_calls", {"session_id": "s-raw", "calls": [
        ["hyatlas_add", {"text": "The spare key is under the blue pot"}],
        ["hyatlas_recent", {"include_raw": "false"}],
        ["hyatlas_recent", {"include_raw": "true"}],
        ["hyatlas_recent", {"include_raw": "maybe"}],
    ]})["answers"]
    added, without_raw, with_raw, unclear = answers
    assert added["success"] is True
    assert contents(without_raw) == []  # lite mode: the note is a raw row only
    assert contents(with_raw) == ["The spare key is under the blue pot"]
    assert "include_raw='maybe'" in unclear["error"]


def test_non_primary_agent_context_never_writes(tmp_path: Path, hermes_python: Path):
    home = make_home(tmp_path, hermes_python, server_url=f"http://127.0.0.1:{free_port()}")
    result = drive(hermes_python, home, "context_writes", {"agent_context": "cron"})
    assert result["writes"] is False and result["outbox"] is False
    assert "does not write" in result["tool"]["error"]
    assert not (home / "hyatlas" / "outbox.sqlite3").exists()


def test_a_corrupt_local_queue_is_moved_aside_and_turns_are_stored(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-corrupt",
                     timeout_s=60.0)
    garbage = b"garbage left by a full disk" * 200
    (home / "hyatlas").mkdir(exist_ok=True)
    (home / "hyatlas" / "outbox.sqlite3").write_bytes(garbage)
    result = drive(hermes_python, home, "turns", {
        "session_id": "s-corrupt", "turns": [["My locker is number 12", "Noted."]],
        "final_query": "locker"})
    assert all(result["flushed"]), result
    [aside] = (home / "hyatlas").glob("outbox.sqlite3.corrupt-*")
    assert aside.read_bytes() == garbage
    stored = contents(gateway(stack, "POST", "/api/v1/list", {"user_id": "u-corrupt"}))
    assert stored == ["USER: My locker is number 12\n\nASSISTANT: Noted."]


def test_each_write_a_local_queue_that_cannot_open_loses_is_logged(
    tmp_path: Path, hermes_python: Path
):
    home = make_home(tmp_path, hermes_python, server_url=f"http://127.0.0.1:{free_port()}")
    (home / "hyatlas" / "outbox.sqlite3").mkdir(parents=True)  # no database opens there
    logged = drive(hermes_python, home, "logged_writes")["logged"]
    unstored = [m for m in logged if "was not stored" in m]
    assert len(unstored) == 2, logged  # the turn and the memory tool's add
    assert all("local queue under" in m and "could not be opened" in m for m in unstored)


def hermes_cli(hermes_python: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`hermes hyatlas ARGS` as a user runs it."""
    return subprocess.run([str(hermes_python.parent / "hermes"), "hyatlas", *args],
                          env=hermes_env(home), capture_output=True, text=True, timeout=60)


def test_agent_and_its_cli_see_the_same_memories_under_a_configured_agent_id(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-cli",
                     agent_id="my-agent")
    # Hermes passes its profile name as the identity; the configured agent_id wins over it.
    agent = drive(hermes_python, home, "tool_calls", {
        "session_id": "s-cli", "init": {"agent_identity": "default"},
        "calls": [["hyatlas_add", {"text": "The Kyoto trip is booked for May"}]]})
    assert agent["ids"] == {"user_id": "u-cli", "agent_id": "my-agent"}
    found = hermes_cli(hermes_python, home, "search", "Kyoto trip")
    assert found.returncode == 0, found.stderr
    assert "The Kyoto trip is booked for May" in found.stdout

    added = hermes_cli(hermes_python, home, "add", "Our", "release", "train", "leaves", "every",
                       "Thursday")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["success"] is True
    recalled = drive(hermes_python, home, "tool_calls", {
        "session_id": "s-cli", "init": {"agent_identity": "default"},
        "calls": [["hyatlas_search", {"query": "release train Thursday"}]]})
    assert "Our release train leaves every Thursday" in contents(recalled["answers"][0])
    refused = hermes_cli(hermes_python, home, "search", "x", "--layer", "l9")
    assert refused.returncode != 0
    owners = hermes_cli(hermes_python, home, "owners")
    assert owners.returncode == 0, owners.stderr
    ours = [line for line in owners.stdout.splitlines() if line.startswith("*")]
    assert [line.split()[1:4] for line in ours] == [["u-cli", "2", "live"],
                                                    ["agent", "my-agent", "2"]]


def test_the_cli_takes_owner_options_after_the_subcommand_and_refuses_a_limit_below_1(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    gateway(stack, "POST", "/api/v1/add", {"text": "The shed key hangs by the back door",
                                           "user_id": "u-after", "agent_id": "a-after"})
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-mine")
    found = hermes_cli(hermes_python, home, "search", "shed key", "--user-id", "u-after",
                       "--agent-id", "a-after")
    assert found.returncode == 0, found.stderr
    assert "The shed key hangs by the back door" in found.stdout
    # Given on both sides, the one after the subcommand wins.
    listed = hermes_cli(hermes_python, home, "--user-id", "u-mine", "recent", "--user-id",
                        "u-after", "--agent-id", "a-after")
    assert listed.returncode == 0, listed.stderr
    assert contents(json.loads(listed.stdout)) == ["The shed key hangs by the back door"]
    for held, expected in (("SHED key", ["The shed key hangs by the back door"]), ("garage", [])):
        listed = hermes_cli(hermes_python, home, "recent", "--contains", held, "--user-id",
                            "u-after", "--agent-id", "a-after")
        assert listed.returncode == 0, listed.stderr
        assert contents(json.loads(listed.stdout)) == expected
    # The server reads a limit of 0 as its own default: the CLI refuses it instead.
    refused = hermes_cli(hermes_python, home, "recent", "--limit", "0")
    assert refused.returncode == 2 and "--limit: 0 is below 1" in refused.stderr


def test_cli_forget_given_both_a_text_and_an_id_is_refused_before_the_server(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    added = gateway(stack, "POST", "/api/v1/add", {"text": "The bike lock code is 4512",
                                                   "user_id": "u-forget-both"})
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-forget-both")
    both = hermes_cli(hermes_python, home, "forget", "The bike lock code is 4512",
                      "--id", added["memory_id"])
    assert both.returncode == 1
    assert both.stderr.strip() == "hyatlas: give a text or a memory id, not both"
    neither = hermes_cli(hermes_python, home, "forget")
    assert neither.returncode == 1
    assert neither.stderr.strip() == "hyatlas: a text or a memory id is required"
    listed = gateway(stack, "POST", "/api/v1/list", {"user_id": "u-forget-both"})
    assert contents(listed) == ["The bike lock code is 4512"]


def test_cli_restore_brings_back_what_cli_forget_retired(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    added = gateway(stack, "POST", "/api/v1/add", {"text": "The attic ladder is in the garage",
                                                   "user_id": "u-cli-restore",
                                                   "agent_id": "default"})
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-cli-restore")
    forgot = hermes_cli(hermes_python, home, "forget", "--id", added["memory_id"])
    assert forgot.returncode == 0, forgot.stderr
    assert contents(gateway(stack, "POST", "/api/v1/list", {"user_id": "u-cli-restore"})) == []
    restored = hermes_cli(hermes_python, home, "restore", added["memory_id"])
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["restored"] is True
    assert contents(gateway(stack, "POST", "/api/v1/list", {"user_id": "u-cli-restore"})) == [
        "The attic ladder is in the garage"]


def test_a_stopped_server_reaches_hermes_warning_callback_once_and_cli_says_how_to_start(
    tmp_path: Path, hermes_python: Path
):
    home = make_home(tmp_path, hermes_python, server_url=f"http://127.0.0.1:{free_port()}")
    result = drive(hermes_python, home, "outage", {"await_check": True,
                                                   "prefetch": ["what is my dog called?"]})
    assert len(result["warnings"]) == 1, result
    assert "unreachable" in result["warnings"][0]
    assert "hermes hyatlas start" in result["warnings"][0]
    assert result["backing_off"] == [True]
    # The system prompt, kept for the whole session, does not claim memory is active.
    prompt = result["system_prompt"]
    assert "did not answer when this session started" in prompt and "is active" not in prompt
    assert "dated when it happened (else when it was stored)" in prompt
    status = hermes_cli(hermes_python, home, "status")
    assert status.returncode == 1 and "hermes hyatlas start" in status.stderr


async def test_a_rejected_token_is_reported_as_a_token_problem(
    tmp_path: Path, hermes_python: Path
):
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "a valid bearer token is required"}, status=401)

    app = web.Application()
    app.router.add_get("/api/v1/status", refuse)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url)
        result = await drive_async(hermes_python, home, "outage", {"await_check": True})
    assert len(result["warnings"]) == 1, result
    assert "refused the plugin's token (HTTP 401)" in result["warnings"][0]


async def test_another_service_at_server_url_is_reported_as_such_in_one_line(
    tmp_path: Path, hermes_python: Path
):
    async def page(request: web.Request) -> web.Response:
        return web.Response(status=501, text="<!DOCTYPE HTML>\n<html lang=\"en\">\n<p>No</p>",
                            content_type="text/html")

    app = web.Application()
    app.router.add_get("/api/v1/status", page)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url)
        result = await drive_async(hermes_python, home, "outage", {"await_check": True})
    [warning] = result["warnings"]
    assert f"something other than HyAtlas memory answers at {url} (HTTP 501: " in warning
    assert '<!DOCTYPE HTML> <html lang="en"> <p>No</p>' in warning and "\n" not in warning
    assert "check server_url" in warning


async def test_another_service_answering_200_json_at_server_url_stores_nothing_and_says_so(
    tmp_path: Path, hermes_python: Path
):
    """An OpenAI-compatible server at server_url answers every route 200 with JSON of its own:
    no queued write counts as stored, the session warns it is not a HyAtlas server, the CLI
    says so too; once a gateway answers there, everything queued is stored."""
    stored: list[str] = []
    other_service = True

    async def answer(request: web.Request) -> web.Response:
        if other_service:
            return web.json_response({"object": "list", "data": []})
        if request.path == "/api/v1/status":
            return web.json_response(GATEWAY_STATUS)
        stored.append((await request.json())["text"])
        return web.json_response({"success": True, "memory_id": f"m{len(stored)}"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url)
        session = await drive_async(hermes_python, home, "outage", {"await_check": True})
        tried = await drive_async(hermes_python, home, "tried",
                                  {"turns": [["My passport expires in June", "Noted."]]})
        shown = await asyncio.to_thread(hermes_cli, hermes_python, home, "status")
        noted = await asyncio.to_thread(hermes_cli, hermes_python, home, "add", "Gate", "4417")
        owners = await asyncio.to_thread(hermes_cli, hermes_python, home, "owners")
        other_service = False
        resumed = await drive_async(hermes_python, home, "resume", {"wait_s": 60})
    [warning] = session["warnings"]
    assert f"{url} is not a HyAtlas server" in warning and "check server_url" in warning
    [op] = tried["queue"]
    assert op["dead"] is False and "is not a HyAtlas server" in op["last_error"], op
    status = tried["status"]
    assert status["plugin_queue"] == 1 and "not a HyAtlas server" in status["error"], status
    assert shown.returncode == 1 and f"{url} is not a HyAtlas server" in shown.stderr
    assert owners.returncode == 1 and f"{url} is not a HyAtlas server" in owners.stderr
    assert json.loads(noted.stdout)["queued"] is True, noted.stdout
    assert resumed["pending"] == 0
    assert sorted(stored) == ["Gate 4417", "USER: My passport expires in June\n\nASSISTANT: Noted."]


def test_after_a_recall_overruns_its_budget_later_recalls_are_skipped_not_waited_on(
    tmp_path: Path, hermes_python: Path
):
    port = free_port()
    home = make_home(tmp_path, hermes_python, server_url=f"http://127.0.0.1:{port}",
                     prefetch_budget_s=1.0, timeout_s=30.0, backoff_s=600.0)
    hung = socket.socket()  # accepts connections, never answers
    hung.bind(("127.0.0.1", port))
    hung.listen(16)
    try:
        result = drive(hermes_python, home, "outage", {"prefetch": ["one", "two", "three"]})
    finally:
        hung.close()
    first, *later = result["prefetch_s"]
    assert first >= 1.0  # the first recall waited its whole budget on the hung server
    # Each later one would wait the budget again; in the back-off none is even asked.
    assert max(later) < 0.5, result
    assert len(result["warnings"]) == 1 and result["backing_off"] == [True, True, True]


async def test_a_late_answer_fills_the_next_turn_and_a_timely_one_ends_the_back_off(
    tmp_path: Path, hermes_python: Path
):
    searches: list[str] = []

    async def search(request: web.Request) -> web.Response:
        query = (await request.json())["query"]
        searches.append(query)
        if len(searches) == 1:
            await asyncio.sleep(2.0)  # a slow server: the first answer comes after the budget
        item = {"memory_id": f"m{len(searches)}", "content": f"answer to {query}",
                "layer": "l2_raw", "score": 0.9, "gmt_created": 1764547200}
        return web.json_response({"memories": {"normal": [item]}, "order": ["normal"]})

    async with serving_http(searching_gateway(search)) as url:
        home = make_home(tmp_path, hermes_python, server_url=url,
                         prefetch_budget_s=0.5, backoff_s=600.0)
        result = await drive_async(hermes_python, home, "outage", {
            "await_check": True, "settle": True, "prefetch": ["first", "second", "third"]})
    first, second, third = result["recalls"]
    assert first == ""  # the budget ran out before the slow answer
    # The late answer is kept for the next turn, which does not wait (the back-off holds,
    # since that answer was late); its own recall runs in the background and answers in time,
    # which ends the back-off, so the third turn waits for its own recall again.
    assert "answer to first" in second
    assert "answer to third" in third
    assert result["backing_off"] == [True, False, False]
    assert searches == ["first", "second", "third"]
    assert len(result["warnings"]) == 1 and "did not answer within 0.5 s" in result["warnings"][0]


async def test_a_turn_gets_the_recall_of_its_own_question_while_the_queued_one_still_runs(
    tmp_path: Path, hermes_python: Path
):
    asked = asyncio.Event()

    async def search(request: web.Request) -> web.Response:
        query = (await request.json())["query"]
        if query == "what is my dentist called":
            await asked.wait()  # the queued recall is still running when the next turn asks
        else:
            asked.set()
        item = {"memory_id": query, "content": f"answer to {query}", "layer": "l3_fact",
                "score": 0.9, "gmt_created": 1764547200}
        return web.json_response({"memories": {"normal": [item]}, "order": ["normal"]})

    async with serving_http(searching_gateway(search)) as url:
        home = make_home(tmp_path, hermes_python, server_url=url, prefetch_budget_s=6.0)
        try:
            result = await drive_async(hermes_python, home, "next_question", {
                "queued": "what is my dentist called",
                "asked": "which flight do I take tomorrow"})
        finally:
            asked.set()
    assert "answer to which flight do I take tomorrow" in result["recall"], result
    assert "dentist" not in result["recall"]


async def test_a_recall_reads_the_question_s_dates_by_the_user_s_clock_and_zone(
    tmp_path: Path, hermes_python: Path
):
    sent: list[str] = []

    async def search(request: web.Request) -> web.Response:
        sent.append((await request.json()).get("reference_time", ""))
        return web.json_response({"memories": {}, "order": []})

    async with serving_http(searching_gateway(search)) as url:
        home = make_home(tmp_path, hermes_python, server_url=url, prefetch_budget_s=6.0)
        # POSIX TZ "PST8" is UTC-8 without any zone file.
        await drive_async(hermes_python, home, "next_question", {
            "queued": "what did I do yesterday", "asked": "and the day before"}, TZ="PST8")
    assert sent and all(stamp.endswith("-08:00") for stamp in sent), sent


async def test_a_recall_shows_as_many_memories_of_a_channel_as_prefetch_limit_asks_for(
    tmp_path: Path, hermes_python: Path
):
    limits: list[int] = []

    async def search(request: web.Request) -> web.Response:
        body = await request.json()
        limits.append(body["limit"])
        items = [{"memory_id": f"m{i}", "content": f"memory number {i}", "layer": "l3_fact",
                  "score": 0.9, "gmt_created": 1764547200} for i in range(body["limit"])]
        return web.json_response({"memories": {"normal": items}, "order": ["normal"]})

    async with serving_http(searching_gateway(search)) as url:
        home = make_home(tmp_path, hermes_python, server_url=url, prefetch_budget_s=6.0,
                         prefetch_limit=7)
        result = await drive_async(hermes_python, home, "next_question", {
            "queued": "what is my dentist called", "asked": "which flight do I take"})
    assert set(limits) == {7}
    assert all(f"memory number {i}" in result["recall"] for i in range(7)), result


def test_dashboard_router_mounts_in_hermes_web_server_and_proxies_search(
    tmp_path: Path, hermes_python: Path, stack: Stack
):
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id="u-dash")
    gateway(stack, "POST", "/api/v1/add",
            {"text": "The garden gate code is 4417", "user_id": "u-dash"})
    result = drive(hermes_python, home, "dashboard", {"query": "garden gate code"})
    assert "hyatlas" in result["plugins"]
    assert result["search_status"] == 200
    assert "The garden gate code is 4417" in contents(result["search"])
    assert "garden gate code is 4417" in result["search"]["recall_text"]
    assert result["status_status"] == 200
    assert result["asset_status"] == 200


def test_gateway_down_prefetch_and_sync_turn_survive_and_turns_sent_when_it_is_back_keep_when_said(
    tmp_path: Path, hermes_python: Path, embedder_address: str
):
    """Turns queued while the gateway is away are stored once it is back, each with the time
    it was said as its event_at (the extractor reads "yesterday" from it), not the delivery's."""
    port = free_port()
    home = make_home(tmp_path, hermes_python, server_url=f"http://127.0.0.1:{port}",
                     user_id="u-down", prefetch_budget_s=1.0, timeout_s=30.0)
    turns = [[f"Turn {i}: my favourite number is {i * 7}", f"Noted {i * 7}"] for i in range(3)]
    # A gateway that accepts connections but never answers: the worst case for a budget.
    hung = socket.socket()
    hung.bind(("127.0.0.1", port))
    hung.listen(16)
    try:
        down = drive(hermes_python, home, "down", {"session_id": "s-down", "turns": turns})
    finally:
        hung.close()
    assert down["errors"] == []
    assert down["pending"] == 3
    # With the gateway gone, `hermes hyatlas add` queues like the tool instead of failing.
    queued = hermes_cli(hermes_python, home, "add", "Noted", "from", "the", "CLI")
    assert queued.returncode == 0, queued.stderr
    assert json.loads(queued.stdout)["queued"] is True
    # The hung gateway never answers and a request would wait timeout_s (30 s): every prefetch
    # that came back sooner was ended by the budget.
    assert max(down["prefetch_s"]) < 30.0, down
    assert len(list((home / "hyatlas").glob("outbox.sqlite3"))) == 1

    back_at = int(time.time())
    with running_stack(tmp_path / "back", ["store", "search", "gateway"],
                       HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_GO_PORT=str(port)) as back:
        resumed = drive(hermes_python, home, "resume", {"wait_s": 30})
        assert resumed["pending"] == 0
        rows = gateway(back, "POST", "/api/v1/list", {"user_id": "u-down"})["memories"]
    assert sorted(row["content"] for row in rows) == sorted(
        [f"USER: {u}\n\nASSISTANT: {a}" for u, a in turns] + ["Noted from the CLI"])
    # Said before the gateway was back, stored after it: each keeps when it was said.
    # (Whole seconds: the last turn may be said in the second the gateway comes back in.)
    assert all(row["event_at"] <= back_at <= row["gmt_created"] for row in rows), rows


@pytest.mark.parametrize(("status", "content_type", "body"), [
    (404, "application/json", '{"error": "not found"}'),  # a service without the route
    (400, "text/html", "<html>Bad Request</html>"),  # a proxy's page, not the gateway's error
], ids=["404-json", "400-html"])
async def test_a_4xx_of_another_service_at_server_url_keeps_the_turn_until_the_gateway_answers(
    tmp_path: Path, hermes_python: Path, status: int, content_type: str, body: str
):
    stored: list[str] = []
    other_service = True

    async def add(request: web.Request) -> web.Response:
        if other_service:
            return web.Response(status=status, text=body, content_type=content_type)
        stored.append((await request.json())["text"])
        return web.json_response({"success": True, "memory_id": "m1"})

    app = web.Application()
    app.router.add_post("/api/v1/add", add)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url)
        tried = await drive_async(hermes_python, home, "tried",
                                  {"turns": [["My passport expires in June", "Noted."]]})
        # A note the user adds is kept the same way, not refused.
        noted = await asyncio.to_thread(
            hermes_cli, hermes_python, home, "add", "The", "gate", "code", "is", "4417")
        assert noted.returncode == 0, noted.stderr
        assert json.loads(noted.stdout)["queued"] is True
        other_service = False
        resumed = await drive_async(hermes_python, home, "resume", {"wait_s": 60})
    [op] = tried["queue"]
    assert op["dead"] is False and f"HTTP {status}" in op["last_error"], op
    assert resumed["pending"] == 0
    assert sorted(stored) == [
        "The gate code is 4417", "USER: My passport expires in June\n\nASSISTANT: Noted."
    ]


async def test_a_write_the_gateway_refused_is_counted_in_status_and_start_sends_it_again(
    tmp_path: Path, hermes_python: Path
):
    stored: list[str] = []
    refusing = True

    async def add(request: web.Request) -> web.Response:
        if refusing:  # e.g. a gateway that lacks something the write needs, until it is fixed
            return web.json_response({"error": "bad body", "success": False}, status=400)
        stored.append((await request.json())["text"])
        return web.json_response({"success": True, "memory_id": "m1"})

    async def status(request: web.Request) -> web.Response:
        return web.json_response(GATEWAY_STATUS)

    async def ready(request: web.Request) -> web.Response:
        return web.json_response(GATEWAY_READY)

    app = web.Application()
    app.router.add_post("/api/v1/add", add)
    app.router.add_get("/api/v1/status", status)
    app.router.add_get("/readyz", ready)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url)
        tried = await drive_async(hermes_python, home, "tried",
                                  {"turns": [["My locker code is 2231", "Noted."]]})
        refusing = False
        shown = await asyncio.to_thread(hermes_cli, hermes_python, home, "status")
        started = await asyncio.to_thread(hermes_cli, hermes_python, home, "start")
    assert [op["dead"] for op in tried["queue"]] == [True]
    assert (tried["status"]["plugin_queue"], tried["status"]["plugin_refused"]) == (0, 1)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["plugin_refused"] == 1
    assert started.returncode == 0, started.stderr
    assert "1 refused writes queued again" in started.stdout
    assert "0 still waiting, 0 refused" in started.stdout
    assert stored == ["USER: My locker code is 2231\n\nASSISTANT: Noted."]


def test_cli_add_while_the_server_is_down_queues_and_hermes_hyatlas_start_sends_it(
    tmp_path: Path, hermes_python: Path, embedder_address: str
):
    port = free_port()
    home = make_home(tmp_path, hermes_python, server_url=f"http://127.0.0.1:{port}",
                     user_id="u-cli-queue")
    queued = hermes_cli(hermes_python, home, "add", "The", "boiler", "is", "serviced", "in", "May")
    assert queued.returncode == 0, queued.stderr
    assert json.loads(queued.stdout)["queued"] is True
    # The server is away: status still shows what waits in the local queue.
    shown = hermes_cli(hermes_python, home, "status")
    assert shown.returncode == 1 and "hermes hyatlas start" in shown.stderr
    assert json.loads(shown.stdout)["plugin_queue"] == 1
    tool = drive(hermes_python, home, "tool_calls", {
        "session_id": "s-cli-queue", "calls": [["hyatlas_status", {}]]})["answers"][0]
    assert "unreachable" in tool["error"] and tool["plugin_queue"] == 1
    with running_stack(tmp_path / "up", ["store", "search", "gateway"],
                       HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_GO_PORT=str(port)) as up:
        started = hermes_cli(hermes_python, home, "start")
        assert started.returncode == 0, started.stderr
        assert "queued writes sent; 0 still waiting, 0 refused" in started.stdout
        stored = contents(gateway(up, "POST", "/api/v1/list", {"user_id": "u-cli-queue"}))
    assert stored == ["The boiler is serviced in May"]


def test_a_note_added_then_forgotten_while_the_server_is_down_is_not_live_once_it_is_back(
    tmp_path: Path, hermes_python: Path, embedder_address: str
):
    """The forget tool and `hermes hyatlas forget` queue like the add does, in order behind
    it: once the server is back, the note is stored and then forgotten."""
    port = free_port()
    home = make_home(tmp_path, hermes_python, server_url=f"http://127.0.0.1:{port}",
                     user_id="u-forget-queue")
    answers = drive(hermes_python, home, "tool_calls", {"session_id": "s-forget-queue", "calls": [
        ["hyatlas_add", {"text": "The spare key is under the red pot"}],
        ["hyatlas_forget", {"text": "The spare key is under the red pot"}],
        ["hyatlas_status", {}],
    ]})["answers"]
    added, forgotten, status = answers
    assert added["queued"] is True and forgotten["queued"] is True, answers
    assert status["plugin_queue"] == 2
    noted = hermes_cli(hermes_python, home, "add", "The", "alarm", "code", "is", "5150")
    dropped = hermes_cli(hermes_python, home, "forget", "The", "alarm", "code", "is", "5150")
    assert json.loads(noted.stdout)["queued"] is True, noted.stderr
    assert json.loads(dropped.stdout)["queued"] is True, dropped.stderr
    with running_stack(tmp_path / "up", ["store", "search", "gateway"],
                       HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_GO_PORT=str(port)) as up:
        resumed = drive(hermes_python, home, "resume", {"wait_s": 60})
        live = contents(gateway(up, "POST", "/api/v1/list", {"user_id": "u-forget-queue"}))
        kept = gateway(up, "POST", "/api/v1/list",
                       {"user_id": "u-forget-queue", "include_superseded": True})["memories"]
    assert resumed["pending"] == 0
    assert live == []
    assert sorted((m["content"], m["superseded_how"]) for m in kept) == [
        ("The alarm code is 5150", "forgotten"),
        ("The spare key is under the red pot", "forgotten")]


async def test_hermes_hyatlas_start_fails_when_the_server_takes_none_of_the_queued_writes(
    tmp_path: Path, hermes_python: Path
):
    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": "the store is busy", "success": False}, status=503)

    async def ready(request: web.Request) -> web.Response:
        return web.json_response(GATEWAY_READY)

    app = web.Application()
    app.router.add_post("/api/v1/add", busy)
    app.router.add_get("/readyz", ready)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url)
        queued = await asyncio.to_thread(hermes_cli, hermes_python, home, "add", "A", "note")
        started = await asyncio.to_thread(hermes_cli, hermes_python, home, "start")
    assert json.loads(queued.stdout)["queued"] is True
    assert started.returncode == 1
    assert "sent" not in started.stdout
    assert "queued writes not sent" in started.stderr and "HTTP 503" in started.stderr
    assert "1 still waiting" in started.stderr


def test_auto_started_server_gets_only_allowlisted_env_once_and_the_key_by_post(
    tmp_path: Path, hermes_python: Path
):
    port = free_port()
    out = tmp_path / "fake"
    out.mkdir()
    home = make_home(
        tmp_path, hermes_python, server_url=f"http://127.0.0.1:{port}", auto_start=True,
        server_command=f"{hermes_python} {FAKE_SERVER} {out}", server_cwd=str(tmp_path),
        mode="lite", start_timeout_s=30,
    )
    result = drive(hermes_python, home, "autostart", {"stop": True, "extra_env": {
        "OPENAI_API_KEY": "sk-agent-secret", "ANTHROPIC_API_KEY": "sk-ant",
        "HERMES_SOMETHING": "x", "HYATLAS_LLM_KEY": "llm-key-for-server",
        "HYATLAS_CUSTOM_FLAG": "kept",
    }})
    assert result["ready"] is True and result["pid"]
    # Alive is not ready: auto start polled readiness past the stand-in's start-up 503s.
    assert len((out / "readyz.txt").read_text().split()) > 3
    env = json.loads((out / "env.json").read_text())
    allowed_os = {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM",
                  "TMPDIR", "TMP", "TEMP"}
    outside = [k for k in env
               if not (k in allowed_os or k.startswith(("LC_", "HYATLAS_")))]
    # Python's own startup may add these to its environ; they were not passed to it.
    outside = [k for k in outside if k not in ("LC_CTYPE",)]
    assert outside == []
    assert "HYATLAS_LLM_KEY" not in env
    assert env["HYATLAS_CUSTOM_FLAG"] == "kept"
    assert env["HYATLAS_GO_PORT"] == str(port) and env["HYATLAS_MODE"] == "lite"
    # Two agents initialised at once: one server process.
    assert len((out / "starts.txt").read_text().split()) == 1
    posts = [json.loads(line) for line in (out / "posts.jsonl").read_text().splitlines()]
    assert {"path": "/api/v1/llm/key", "body": {"key": "llm-key-for-server"}} in posts
    assert result["alive_after_stop"] is False
    assert not (home / "hyatlas" / "server.pid").exists()


@pytest.mark.parametrize("readyz", [None, {"ready": True}])
async def test_start_refuses_another_service_whose_health_or_readiness_says_ok(
    tmp_path: Path, hermes_python: Path, readyz: dict[str, Any] | None
):
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(request: web.Request) -> web.Response:
        return web.json_response(readyz)

    app = web.Application()
    app.router.add_get("/healthz", ok)
    app.router.add_get("/api/v1/status", ok)
    if readyz is not None:
        app.router.add_get("/readyz", ready)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url, auto_start=True,
                         server_command="false", server_cwd=str(tmp_path))
        started = await asyncio.to_thread(hermes_cli, hermes_python, home, "start")
    assert started.returncode == 1, started.stdout
    assert f"{url} is not a HyAtlas server" in started.stderr, started.stderr


def test_a_recall_while_auto_start_waits_for_the_server_leaves_the_warning_to_auto_start(
    tmp_path: Path, hermes_python: Path
):
    """The server is not up yet because auto start is starting it: no "start it with ..." for
    the first turn; the one warning of the outage is auto start's own outcome."""
    home = make_home(tmp_path, hermes_python, server_url=f"http://127.0.0.1:{free_port()}",
                     auto_start=True, server_command="sleep 600", server_cwd=str(tmp_path),
                     start_timeout_s=600)
    result = drive(hermes_python, home, "starting")
    assert result["still_starting"] is True, result  # the recall ran during the start
    assert result["recall"] == ""
    assert result["warned_while_starting"] == []
    [warning] = result["warnings"]
    assert warning.startswith("HyAtlas auto start did not get a ready server"), warning


def test_the_plugins_state_files_are_private_to_the_user_under_a_umask_of_022(
    tmp_path: Path, hermes_python: Path
):
    """The outbox (queued memory text), its -wal and -shm, the server's log and pid file are
    0600 in a 0700 folder, also when an older version left that folder 0755."""
    port = free_port()
    out = tmp_path / "fake"
    out.mkdir()
    home = make_home(
        tmp_path, hermes_python, server_url=f"http://127.0.0.1:{port}", auto_start=True,
        server_command=f"{hermes_python} {FAKE_SERVER} {out}", server_cwd=str(tmp_path),
        start_timeout_s=30,
    )
    (home / "hyatlas").mkdir(mode=0o755)
    (home / "hyatlas").chmod(0o755)
    result = drive(hermes_python, home, "autostart", {"stop": True, "umask": 0o022})
    assert result["ready"] is True, result
    modes = result["modes"]
    assert {"outbox.sqlite3", "outbox.sqlite3-wal", "outbox.sqlite3-shm", "server.log",
            "server.pid", "server.lock"} <= modes.keys(), modes
    assert modes.pop(".") == "0o700"
    assert set(modes.values()) == {"0o600"}, modes


@pytest.mark.parametrize("recorded", ["{pid}\n", "{pid} 1\n"],
                         ids=["pid-only", "another-start-time"])
def test_a_pid_file_naming_a_reused_pid_neither_stops_auto_start_nor_gets_that_process_killed(
    tmp_path: Path, hermes_python: Path, recorded: str
):
    port = free_port()
    out = tmp_path / "fake"
    out.mkdir()
    home = make_home(
        tmp_path, hermes_python, server_url=f"http://127.0.0.1:{port}", auto_start=True,
        server_command=f"{hermes_python} {FAKE_SERVER} {out}", server_cwd=str(tmp_path),
        start_timeout_s=30,
    )
    # The server that wrote the pid file is gone, and an unrelated process now has its pid.
    unrelated = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        (home / "hyatlas").mkdir(exist_ok=True)
        (home / "hyatlas" / "server.pid").write_text(recorded.format(pid=unrelated.pid))
        result = drive(hermes_python, home, "autostart", {"stop": True})
        assert unrelated.poll() is None  # stop sent it no signal
    finally:
        unrelated.kill()
        unrelated.wait()
    assert result["ready"] is True and result["pid"] not in (None, unrelated.pid), result
    assert len((out / "starts.txt").read_text().split()) == 1
    assert result["alive_after_stop"] is False


def test_save_config_keeps_secrets_out_of_json_and_env_wins_over_files(
    tmp_path: Path, hermes_python: Path
):
    home = make_home(tmp_path, hermes_python, server_url="http://127.0.0.1:9", mode="pro")
    result = drive(hermes_python, home, "config", {
        "values": {"mode": "server default", "llm_key": "sk-must-not-be-saved", "token": "t",
                   "auto_start": "true", "user_id": "json-user"},
        "environ": {"HYATLAS_USER_ID": "env-user"},
        "read": ["mode", "user_id", "auto_start", "server_url", "llm_key"],
    })
    assert result["mode"] == "0o600"
    assert "llm_key" not in result["saved"] and "token" not in result["saved"]
    assert "mode" not in result["saved"]  # "server default" leaves the mode to the server
    assert result["saved"]["auto_start"] is True
    # config.yaml (mode: pro) wins over hyatlas.json; the environment wins over both.
    assert result["loaded"] == {"mode": "pro", "user_id": "env-user", "auto_start": True,
                                "server_url": "http://127.0.0.1:9", "llm_key": ""}
    assert result["available"] is True



def test_the_server_default_choice_hermes_setup_writes_into_config_yaml_leaves_it_to_the_server(
    tmp_path: Path, hermes_python: Path
):
    # Hermes's wizard stores each choice in config.yaml's memory.hyatlas section when it exists.
    home = make_home(tmp_path, hermes_python, server_url="http://127.0.0.1:9",
                     mode="server default", sync="server default")
    result = drive(hermes_python, home, "config", {"values": {}, "read": ["mode", "sync"]})
    assert result["loaded"] == {"mode": "", "sync": ""}
    assert result["available"] is True


@pytest.mark.parametrize(("values", "error", "saved"), [
    ({"server_url": "ftp://localhost:19528", "user_id": "alice"},
     "server_url='ftp://localhost:19528' is not an http(s) URL; not saved, server_url stays "
     "'http://127.0.0.1:19528' (the other answers were saved)", {"user_id": "alice"}),
    ({"mode": "max"}, "mode='max' is not one of lite, pro, ultra; not saved, mode stays '' "
     "(the other answers were saved)", {}),
], ids=["url", "mode"])
def test_a_setup_value_the_plugin_could_not_load_is_refused_and_the_other_answers_saved(
    tmp_path: Path, hermes_python: Path, values: dict[str, str], error: str,
    saved: dict[str, str]
):
    home = make_home(tmp_path, hermes_python)
    result = drive(hermes_python, home, "refused_config", {"values": values})
    assert result["error"] == error
    # hyatlas.json keeps what the installer wrote, and the provider stays available.
    assert json.loads(result["saved"]) == {"server_cwd": str(ROOT), **saved}
    assert result["available"] is True


def test_a_server_url_given_as_host_and_port_is_saved_as_an_http_url(
    tmp_path: Path, hermes_python: Path
):
    """What a user types at `hermes memory setup`'s question: host:port means the gateway."""
    home = make_home(tmp_path, hermes_python)
    result = drive(hermes_python, home, "config", {
        "values": {"server_url": "127.0.0.1:23400"}, "read": ["server_url"]})
    assert result["saved"]["server_url"] == "http://127.0.0.1:23400"
    assert result["loaded"] == {"server_url": "http://127.0.0.1:23400"}


def hermes_memory_setup(hermes_python: Path, home: Path, answers: list[str]
                        ) -> subprocess.CompletedProcess[str]:
    """`hermes memory setup hyatlas` with the answers typed one a line (no terminal: the
    pickers keep their current choice, secrets are read from stdin)."""
    return subprocess.run([str(hermes_python.parent / "hermes"), "memory", "setup", "hyatlas"],
                          env=hermes_env(home), input="".join(f"{a}\n" for a in answers),
                          capture_output=True, text=True, timeout=120, start_new_session=True)


def test_memory_setup_asks_again_for_a_url_it_could_not_load_and_says_saved_only_when_saved(
    tmp_path: Path, hermes_python: Path
):
    home = make_home(tmp_path, hermes_python)
    (home / "config.yaml").write_text("model: {}\n")  # not yet the memory provider
    installed = (home / "hyatlas.json").read_text()
    given_up = hermes_memory_setup(hermes_python, home, ["ftp://x", "gopher://y", "http://:1"])
    assert given_up.returncode == 0, given_up.stderr
    assert "no valid server_url after 3 tries. Nothing was saved." in given_up.stdout
    assert "saved to" not in given_up.stdout and "provider config saved" not in given_up.stdout
    assert (home / "hyatlas.json").read_text() == installed
    done = hermes_memory_setup(hermes_python, home, [
        "ftp://x", "127.0.0.1:23400", "alice", "", "", "", "", "", "", "", ""])
    assert done.returncode == 0, done.stderr
    assert "server_url='ftp://x' is not an http(s) URL; try again" in done.stdout
    assert f"Settings saved to {home / 'hyatlas.json'}" in done.stdout
    saved = json.loads((home / "hyatlas.json").read_text())
    assert (saved["server_url"], saved["user_id"]) == ("http://127.0.0.1:23400", "alice")
    assert saved["server_cwd"] == str(ROOT)  # a blank answer keeps what was there
    assert "provider: hyatlas" in (home / "config.yaml").read_text()


class Terminal:
    """`hermes memory setup hyatlas` on a pseudo-terminal (so Hermes draws its curses pickers),
    typed into as a user would."""

    def __init__(self, hermes_python: Path, home: Path) -> None:
        self._master, slave = os.openpty()
        # Wide enough for the mode picker's title; curses reads the size from the terminal.
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.proc = subprocess.Popen(
            [str(hermes_python.parent / "hermes"), "memory", "setup", "hyatlas"],
            env=hermes_env(home, TERM="xterm"), stdin=slave, stdout=slave, stderr=slave,
            start_new_session=True)
        os.close(slave)
        self.seen = ""

    def expect(self, text: str, timeout_s: float = 60.0) -> None:
        """Reads what the terminal shows until text is among it (escape codes aside)."""
        deadline = time.monotonic() + timeout_s
        while text not in self.seen:
            left_s = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._master], [], [], left_s)
            assert ready, f"{text!r} never showed; the terminal showed:\n{self.seen[-3000:]}"
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # the process ended and closed the terminal
                chunk = b""
            assert chunk, f"{text!r} never showed before setup ended:\n{self.seen[-3000:]}"
            self.seen += re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][0-9A-B]|\x1b[=>]", "",
                                chunk.decode("utf-8", "replace"))
        self.seen = self.seen[self.seen.index(text) + len(text):]

    def answer(self, prompt: str, keys: str) -> None:
        """Waits for prompt, then types keys."""
        self.expect(prompt)
        os.write(self._master, keys.encode())

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:  # a failed expectation left setup waiting for input
            self.proc.kill()
            self.proc.wait()
        os.close(self._master)

    def exit_code(self) -> int:
        """Waits for setup to end; its exit code."""
        return self.proc.wait(timeout=60)


def test_memory_setup_in_a_terminal_takes_each_picker_choice_and_a_cancel_saves_nothing(
    tmp_path: Path, hermes_python: Path
):
    home = make_home(tmp_path, hermes_python)
    (home / "config.yaml").write_text("model: {}\n")  # not yet the memory provider
    installed = (home / "hyatlas.json").read_text()
    with Terminal(hermes_python, home) as cancelled:
        for prompt in ("HyAtlas gateway URL", "User id for memories", "Agent id for memories"):
            cancelled.answer(prompt, "\r")
        cancelled.answer("Start the server when it does not answer", "q")
        cancelled.expect("Setup cancelled. Nothing was saved.")
        assert cancelled.exit_code() == 0
    assert (home / "hyatlas.json").read_text() == installed
    assert "hyatlas" not in (home / "config.yaml").read_text()
    with Terminal(hermes_python, home) as term:
        term.answer("HyAtlas gateway URL", "127.0.0.1:23401\r")
        term.answer("User id for memories", "alice\r")
        for prompt in ("Agent id for memories", "Start the server when it does not answer",
                       "Command that starts the server", "Folder the command runs in",
                       "Server data directory"):
            term.answer(prompt, "\r")
        term.answer("Mode for a started server", "jj\r")  # server default, lite, pro
        term.answer("Writes wait for extraction", "jj\r")  # server default, off, on
        for prompt in ("LLM base URL", "LLM model name", "LLM API key", "Server bearer token"):
            term.answer(prompt, "\r")
        term.expect(f"Settings saved to {home / 'hyatlas.json'}")
        assert term.exit_code() == 0
    saved = json.loads((home / "hyatlas.json").read_text())
    assert {k: saved.get(k) for k in ("server_url", "user_id", "auto_start", "mode", "sync")} == {
        "server_url": "http://127.0.0.1:23401", "user_id": "alice", "auto_start": False,
        "mode": "pro", "sync": "on"}, saved
    assert "provider: hyatlas" in (home / "config.yaml").read_text()


async def test_a_server_url_the_plugin_cannot_use_is_shown_in_the_session_and_turns_wait(
    tmp_path: Path, hermes_python: Path
):
    """HYATLAS_SERVER_URL is not an http(s) URL: Hermes's warning says so at session start,
    the turn waits in the local queue (not sent anywhere), and a session with a working
    config sends it."""
    stored: list[tuple[str, str]] = []

    async def add(request: web.Request) -> web.Response:
        body = await request.json()
        stored.append((body["user_id"], body["text"]))
        return web.json_response({"success": True, "memory_id": f"m{len(stored)}"})

    async def search(request: web.Request) -> web.Response:
        return web.json_response({"memories": {}})

    app = searching_gateway(search)
    app.router.add_post("/api/v1/add", add)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url, user_id="u-misconfigured")
        bad = await drive_async(hermes_python, home, "misconfigured", {},
                                HYATLAS_SERVER_URL="ftp://127.0.0.1:19528")
        resumed = await drive_async(hermes_python, home, "resume", {"wait_s": 60})
    problem = "HYATLAS_SERVER_URL='ftp://127.0.0.1:19528' is not an http(s) URL"
    assert bad["available"] is True, bad
    [warning] = bad["warnings"]
    assert problem in warning and "wait in the local queue" in warning, warning
    assert bad["pending"] == 1
    assert problem in bad["tool"]["error"] and problem in bad["status_config"]["config_error"]
    assert "is off this session" in bad["system_prompt"]
    assert resumed["pending"] == 0
    assert stored == [("u-misconfigured", "USER: My locker code is 2231\n\nASSISTANT: Noted.")]


def test_an_unreadable_hyatlas_json_keeps_no_turn_since_it_may_name_their_owner(
    tmp_path: Path, hermes_python: Path
):
    """hyatlas.json may hold the user id: a turn queued without it could be delivered to
    another user's memories, so the session says what is wrong and keeps none."""
    home = make_home(tmp_path, hermes_python, server_url=f"http://127.0.0.1:{free_port()}")
    (home / "hyatlas.json").write_text('{"user_id": "alice",')
    result = drive(hermes_python, home, "misconfigured")
    [warning] = result["warnings"]
    assert "hyatlas.json: not a readable JSON object" in warning, warning
    assert "turns are not stored" in warning
    assert result["pending"] is None
    assert not (home / "hyatlas" / "outbox.sqlite3").exists()


def test_a_timeout_budget_or_limit_that_is_not_above_0_is_refused_naming_the_setting(
    tmp_path: Path, hermes_python: Path
):
    home = make_home(tmp_path, hermes_python, server_url="http://127.0.0.1:9", timeout_s=0)
    fine = {"HYATLAS_TIMEOUT_S": "0.5"}  # the environment wins over config.yaml's timeout_s: 0
    result = drive(hermes_python, home, "refused_settings", {"environs": [
        {"HYATLAS_TIMEOUT_S": "-1"}, {**fine, "HYATLAS_PREFETCH_BUDGET_S": "0"},
        {**fine, "HYATLAS_START_TIMEOUT_S": "inf"}, {**fine, "HYATLAS_PREFETCH_LIMIT": "0"}, fine,
    ]})
    assert result["errors"] == [
        "HYATLAS_TIMEOUT_S='-1' must be a number above 0",
        "HYATLAS_PREFETCH_BUDGET_S='0' must be a number above 0",
        "HYATLAS_START_TIMEOUT_S='inf' must be a number above 0",
        "HYATLAS_PREFETCH_LIMIT='0' must be a number above 0",
        "",
    ]
    # config.yaml's own timeout_s: 0. The provider is still available: it says what is wrong
    # at session start and keeps the turns in the local queue.
    assert result["available"] is True
    status = hermes_cli(hermes_python, home, "status")
    assert status.returncode == 1
    assert f"{home / 'config.yaml'}: timeout_s=0 must be a number above 0" in status.stderr
