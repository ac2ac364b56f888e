"""The gateway over real HTTP in front of real store, search and embedder processes."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.openapi import document
from shared.clients import EmbedderClient
from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from tests.support import Stack, assert_eventually, running_stack

pytestmark = pytest.mark.slow

ALIASES = "alias-main,alias-other"
TOKEN = "t0ken-for-tests"
CHANNELS = {"pages", "profile", "proactive", "experiences", "normal"}
LAYERS = [
    "l1_profile",
    "l2_raw",
    "l3_fact",
    "l4_summary",
    "l5_knowledge",
    "l6_schema",
    "l7_intention",
    "l8_entity",
]


@dataclass
class Api:
    """A REST client for one running gateway."""

    base_url: str
    token: str = ""

    async def call(
        self, method: str, path: str, headers: dict[str, str] | None = None, **kw: Any
    ) -> tuple[int, Any]:
        """Status and decoded JSON body of one request."""
        all_headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        all_headers.update(headers or {})
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.base_url + path, headers=all_headers, **kw) as reply,
        ):
            assert "Access-Control-Allow-Origin" not in reply.headers
            return reply.status, await reply.json()

    async def add(self, text: str, user_id: str, **fields: Any) -> dict[str, Any]:
        status, body = await self.call(
            "POST", "/api/v1/add", json={"text": text, "user_id": user_id, **fields}
        )
        assert status == 200, body
        return body

    async def listing(self, user_id: str, **fields: Any) -> dict[str, Any]:
        status, body = await self.call(
            "POST", "/api/v1/list", json={"user_id": user_id, "limit": 1000, **fields}
        )
        assert status == 200, body
        return body

    async def total(self) -> int:
        status, body = await self.call("GET", "/api/v1/metrics")
        assert status == 200, body
        return int(body["total"])


def _user() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def lite(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    """A lite stack: no admin, no token, one alias group."""
    data_dir: Path = tmp_path_factory.mktemp("gateway-lite")
    with running_stack(
        data_dir,
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_USER_ALIASES=ALIASES,
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def ultra(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    """An ultra stack with an LLM configured (never called yet), admin on and a token."""
    data_dir: Path = tmp_path_factory.mktemp("gateway-ultra")
    with running_stack(
        data_dir,
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_MODE="ultra",
        HYATLAS_LLM_BASE="http://127.0.0.1:9/v1",
        HYATLAS_LLM_MODEL="scripted",
        HYATLAS_LLM_KEY="k",
        HYATLAS_ADMIN="on",
        HYATLAS_TOKEN=TOKEN,
    ) as stack:
        yield stack


@pytest.fixture
def api(lite: Stack) -> Api:
    return Api(lite.base_url)


@pytest.fixture
def admin_api(ultra: Stack) -> Api:
    return Api(ultra.base_url, TOKEN)


# --- add and search ----------------------------------------------------------------------


async def test_add_then_search_finds_the_text(api: Api) -> None:
    user = _user()
    added = await api.add("My favourite code editor is Helix, with the kakoune keymap.", user)
    assert added["success"] is True and added["extraction_status"] == "skipped"
    assert added["memory_id"]

    status, body = await api.call(
        "POST", "/api/v1/search", json={"query": "favourite code editor", "user_id": user}
    )
    assert status == 200, body
    assert set(body["memories"]) == CHANNELS
    hits = [item for items in body["memories"].values() for item in items]
    assert [hit["memory_id"] for hit in hits] == [added["memory_id"]]
    hit = hits[0]
    assert hit["content"].startswith("My favourite code editor is Helix")
    assert hit["layer"] == "l2_raw" and hit["user_id"] == user
    assert hit["agent_id"] == ""  # every item carries both owner fields, as list's do
    reply = document()["paths"]["/api/v1/search"]["post"]["responses"]["200"]
    item = reply["content"]["application/json"]["schema"]["properties"]["memories"]
    assert set(item["additionalProperties"]["items"]["required"]) <= set(hit)
    assert isinstance(hit["score"], float) and 0 < hit["score"] <= 1
    assert abs(hit["gmt_created"] - time.time()) < 600
    assert isinstance(body["order"], list)
    assert "now" not in body

    status, other = await api.call(
        "POST", "/api/v1/search", json={"query": "favourite code editor", "user_id": _user()}
    )
    assert status == 200
    assert not any(other["memories"].values())


async def test_search_reads_the_one_owner_user_ids_and_agent_ids_name(api: Api) -> None:
    user = _user()
    mine = await api.add("The staging database runs on port 5433.", user, agent_id="ops-bot")
    await api.add("The staging database runs on port 6543.", user, agent_id="other-bot")
    status, body = await api.call(
        "POST",
        "/api/v1/search",
        json={
            "query": "staging database port",
            "user_id": user,
            "user_ids": [user, ""],
            "agent_ids": ["ops-bot", "", "ops-bot"],
            "min_score": 0,
            "limit": 10,
        },
    )
    assert status == 200, body
    hits = [item for items in body["memories"].values() for item in items]
    assert [hit["memory_id"] for hit in hits] == [mine["memory_id"]]
    assert hits[0]["agent_id"] == "ops-bot"
    # Several users at once are not searched (only the first would have been, unsaid).
    status, body = await api.call("POST", "/api/v1/search", json={
        "query": "staging database port", "user_id": user, "user_ids": ["someone-else"]})
    assert status == 400 and "a search covers one user (2 named" in body["error"]
    status, body = await api.call("POST", "/api/v1/search", json={
        "query": "staging database port", "user_id": user, "agent_ids": ["ops-bot", "other-bot"]})
    assert status == 400 and "a search covers one agent (2 named" in body["error"]
    # A list in the query string is its name repeated; a single value repeated is refused.
    status, body = await api.call("GET", "/api/v1/search", params=[
        ("query", "staging database port"), ("user_id", user),
        ("agent_ids", "ops-bot"), ("agent_ids", "other-bot")])
    assert status == 400 and "a search covers one agent (2 named" in body["error"]
    status, body = await api.call("GET", "/api/v1/search", params=[
        ("query", "staging"), ("query", "port"), ("user_id", user)])
    assert status == 400 and "query is given 2 times" in body["error"]


async def test_search_and_list_cover_the_alias_group(api: Api) -> None:
    added = await api.add("Alias note: the boat is called Minnow.", "alias-other")
    status, body = await api.call(
        "POST", "/api/v1/search", json={"query": "boat called Minnow", "user_id": "alias-main"}
    )
    assert status == 200
    hits = [item["memory_id"] for items in body["memories"].values() for item in items]
    assert added["memory_id"] in hits
    listed = await api.listing("alias-main")
    assert added["memory_id"] in [m["memory_id"] for m in listed["memories"]]


async def test_query_dates_are_read_in_the_days_of_the_reference_times_utc_offset(
    api: Api,
) -> None:
    user = _user()
    # Tuesday and Wednesday mornings at UTC-8: both fall on Tuesday and Wednesday in UTC too.
    tuesday = await api.add("I repotted the fern.", user, event_at="2024-05-14T10:00:00-08:00")
    wednesday = await api.add("I repotted the cactus.", user, event_at="2024-05-15T10:00:00-08:00")

    async def first_hit(reference_time: str) -> str:
        status, body = await api.call("POST", "/api/v1/search", json={
            "query": "what did I repot yesterday", "user_id": user, "min_score": 0,
            "reference_time": reference_time})
        assert status == 200, body
        return str(body["memories"]["normal"][0]["memory_id"])

    # Wednesday 20:00 at UTC-8 is Thursday 04:00 in UTC: "yesterday" is Tuesday there, and
    # Wednesday for a caller whose reference time carries no offset.
    assert await first_hit("2024-05-15T20:00:00-08:00") == tuesday["memory_id"]
    assert await first_hit("2024-05-16T04:00:00Z") == wednesday["memory_id"]


async def test_add_stores_owner_session_metadata_and_event_date(api: Api) -> None:
    user = _user()
    added = await api.add(
        "We moved to Lisbon.",
        user,
        agent_id="hermes",
        session_id="sess-1",
        metadata={"source": "locomo", "turn": 3, "tags": ["move"], "nested": {"ok": True}},
        event_at="2023-05-08",
    )
    listed = await api.listing(user)
    assert listed["total"] == 1 and listed["offset"] == 0 and listed["limit"] == 1000
    (item,) = listed["memories"]
    assert item["memory_id"] == added["memory_id"]
    assert item["content"] == "We moved to Lisbon."
    assert (item["user_id"], item["agent_id"], item["session_id"]) == (user, "hermes", "sess-1")
    assert item["layer"] == "l2_raw"
    assert item["event_at"] == 1683504000
    assert item["extraction_status"] == "skipped" and item["extracted"] is False
    assert time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(item["gmt_created"])) == item["ts"]
    assert listed["layers"]["l2_raw"] == 1 and list(listed["layers"]) == LAYERS
    assert (listed["graph_nodes"], listed["graph_edges"]) == (0, 0)

    status, body = await api.call(
        "POST", "/api/v1/search", json={"query": "moved to Lisbon", "user_id": user}
    )
    hits = [item for items in body["memories"].values() for item in items]
    assert hits[0]["event_at"] == 1683504000 and hits[0]["agent_id"] == "hermes"


async def test_event_at_accepts_unix_seconds_and_rfc3339(api: Api) -> None:
    user = _user()
    await api.add("first", user, event_at=1700000000)
    await api.add("second", user, event_at="2023-11-14T22:13:20+00:00")
    await api.add("third", user, event_at="2023-11-14T23:13:20+01:00")
    listed = await api.listing(user)
    assert [m["event_at"] for m in listed["memories"]] == [1700000000] * 3
    # Each row shows the writer's UTC offset its time was given with (none: UTC).
    offsets = {m["content"]: m["utc_offset_minutes"] for m in listed["memories"]}
    assert offsets == {"first": 0, "second": 0, "third": 60}, offsets


async def test_add_without_user_id_belongs_to_default(api: Api) -> None:
    status, added = await api.call("POST", "/api/v1/add", json={"data": "Owned by default."})
    assert status == 200, added
    listed = await api.listing("default")
    assert added["memory_id"] in [m["memory_id"] for m in listed["memories"]]


# --- bad input changes nothing -------------------------------------------------------------


async def test_bad_input_is_refused_and_stores_nothing(api: Api) -> None:
    user = _user()
    await api.add("one row so the owner exists", user)
    before_total = await api.total()
    before_writes = (await api.call("GET", "/api/v1/status"))[1]["writes"]
    bad: list[tuple[dict[str, Any], int]] = [
        ({"json": {"user_id": user}}, 400),
        ({"json": {"text": "", "user_id": user}}, 400),
        ({"data": b'{"text": "half', "headers": {"Content-Type": "application/json"}}, 400),
        ({"data": b'["not", "an", "object"]'}, 400),
        ({"json": {"text": 42, "user_id": user}}, 400),
        ({"json": {"text": "x", "user_id": user, "metadata": "k=v"}}, 400),
        ({"json": {"text": "x", "user_id": user, "event_at": "someday"}}, 400),
        ({"json": {"text": "x", "user_id": ["a"]}}, 400),
        (
            {"data": io.BytesIO(json.dumps({"text": "a" * (9 << 20), "user_id": user}).encode())},
            413,
        ),
    ]
    for kw, expected in bad:
        status, body = await api.call("POST", "/api/v1/add", **kw)
        assert status == expected, (kw.get("json"), body)
        assert body["success"] is False and body["error"]
    assert await api.total() == before_total
    assert (await api.listing(user))["total"] == 1
    assert (await api.call("GET", "/api/v1/status"))[1]["writes"] == before_writes


async def test_a_text_over_the_limit_is_413_with_its_reason_and_stores_nothing(
    api: Api,
) -> None:
    user = _user()
    # Refused by the gateway before any service is asked: the client's fault (413), never a
    # backing service being away (503).
    status, body = await api.call(
        "POST", "/api/v1/add", json={"text": "a" * 100_001, "user_id": user})
    assert status == 413, body
    assert "the limit is 100,000" in body["error"] and body["success"] is False
    assert (await api.listing(user))["total"] == 0


async def test_unknown_layer_or_reader_is_400_and_nothing_changes(api: Api) -> None:
    user = _user()
    await api.add("layer check row", user)
    before = await api.total()
    for method, path, kw in (
        ("POST", "/api/v1/search", {"json": {"query": "row", "layer": "l9_dreams"}}),
        ("POST", "/api/v1/search", {"json": {"query": "row", "reader": "l9_dreams"}}),
        ("GET", "/api/v1/list", {"params": {"layer": "l9_dreams", "user_id": user}}),
        ("POST", "/api/v1/delete_all", {"json": {"layer": "l9_dreams", "user_id": user}}),
    ):
        status, body = await api.call(method, path, **kw)
        assert status == 400 and "l9_dreams" in body["error"], (path, body)
    assert await api.total() == before
    assert (await api.listing(user))["total"] == 1


async def test_a_limit_over_the_maximum_or_negative_is_refused_never_cut(api: Api) -> None:
    user = _user()
    await api.add("limit check row", user)
    status, body = await api.call(
        "POST", "/api/v1/search", json={"query": "row", "user_id": user, "limit": 101})
    assert status == 400 and "over the maximum of 100" in body["error"]
    for method, kw in (("POST", "json"), ("GET", "params")):
        status, body = await api.call(method, "/api/v1/search", **{kw: {
            "query": "row", "user_id": user, "limit": -1}})
        assert status == 400 and "limit must not be negative" in body["error"], body
        status, body = await api.call(method, "/api/v1/list", **{kw: {"user_id": user,
                                                                      "limit": 5000}})
        assert status == 400 and "over the maximum of 1000" in body["error"], body
        status, body = await api.call(method, "/api/v1/list", **{kw: {"user_id": user,
                                                                      "limit": -5}})
        assert status == 400 and "limit must not be negative" in body["error"], body
    assert (await api.listing(user, limit=0))["limit"] == 20
    status, body = await api.call(
        "POST", "/api/v1/search", json={"query": "limit check", "user_id": user, "limit": 0})
    assert status == 200 and sum(map(len, body["memories"].values())) == 1, body


# --- list ----------------------------------------------------------------------------------


async def test_list_pages_newest_first_and_include_raw_false_hides_raw(api: Api) -> None:
    user = _user()
    ids = [(await api.add(f"entry number {n}", user))["memory_id"] for n in range(3)]
    status, page = await api.call("GET", "/api/v1/list", params={"user_id": user, "limit": "2"})
    assert status == 200
    assert page["total"] == 3 and page["limit"] == 2
    assert [m["memory_id"] for m in page["memories"]] == ids[::-1][:2]
    status, rest = await api.call(
        "POST", "/api/v1/list", json={"user_id": user, "limit": 2, "offset": 2}
    )
    assert [m["memory_id"] for m in rest["memories"]] == ids[:1]
    status, hidden = await api.call(
        "GET", "/api/v1/list", params={"user_id": user, "include_raw": "false"}
    )
    assert (hidden["total"], hidden["memories"]) == (0, [])
    status, by_layer = await api.call(
        "POST", "/api/v1/list", json={"user_id": user, "include_raw": False, "layer": "l2_raw"}
    )
    assert by_layer["total"] == 3
    status, default_limit = await api.call("GET", "/api/v1/list", params={"user_id": user})
    assert default_limit["limit"] == 20


async def test_list_pages_on_with_before_past_rows_added_meanwhile(api: Api) -> None:
    user = _user()
    ids = [(await api.add(f"entry number {n}", user))["memory_id"] for n in range(3)]
    page = await api.listing(user, limit=2)
    assert [m["memory_id"] for m in page["memories"]] == ids[:0:-1]
    await api.add("entry number 3", user)  # offset 2 would show entry 1 again
    status, rest = await api.call("GET", "/api/v1/list", params={
        "user_id": user, "limit": "2", "before": page["next_before"]})
    assert status == 200, rest
    assert [m["memory_id"] for m in rest["memories"]] == ids[:1] and rest["total"] == 4
    end = await api.listing(user, before=rest["next_before"])
    assert (end["memories"], end["next_before"]) == ([], "")
    for cursor in ("x", "nan:5", "-inf:5", "inf:5", "1e999:5"):  # no list gives these
        status, body = await api.call(
            "POST", "/api/v1/list", json={"user_id": user, "before": cursor}
        )
        assert status == 400 and "not one a list returned" in body["error"], cursor


async def test_list_keeps_the_rows_holding_a_text_and_counts_them(api: Api) -> None:
    user = _user()
    ids = [(await api.add(text, user))["memory_id"]
           for text in ("My PASSPORT expires in May.", "Renew the passport.", "Buy milk.")]
    status, page = await api.call("GET", "/api/v1/list", params={
        "user_id": user, "contains": "Passport", "limit": "1"})
    assert status == 200, page
    assert page["total"] == 2 and [m["memory_id"] for m in page["memories"]] == [ids[1]]
    rest = await api.listing(user, contains="Passport", before=page["next_before"])
    assert [m["memory_id"] for m in rest["memories"]] == [ids[0]]
    status, body = await api.call("POST", "/api/v1/list", json={
        "user_id": user, "contains": "p" * 257})
    assert status == 400 and "contains" in body["error"], body


async def test_list_shows_retired_rows_only_with_include_superseded(api: Api, lite: Stack) -> None:
    user = _user()
    old = (await api.add("The wifi password is hunter2.", user))["memory_id"]
    new = (await api.add("The wifi password is now correct-horse.", user))["memory_id"]
    async with open_channel(lite.address("store")) as channel:
        await store_pb2_grpc.StoreStub(channel).Apply(
            store_pb2.ApplyRequest(
                scope=common_pb2.Scope(user_id=user),
                ops=[
                    store_pb2.Op(
                        retire=store_pb2.RetireOp(
                            id=old,
                            superseded_how="replaced",
                            superseded_by=new,
                            drop_reason="password changed",
                        )
                    )
                ],
                actor="api",
            ),
            timeout=30,
        )
    live = await api.listing(user)
    assert [m["memory_id"] for m in live["memories"]] == [new]
    assert "invalid_at" not in live["memories"][0]
    everything = await api.listing(user, include_superseded=True)
    assert everything["total"] == 2
    retired = {m["memory_id"]: m for m in everything["memories"]}[old]
    assert retired["superseded_by"] == new and retired["superseded_how"] == "replaced"
    assert retired["drop_reason"] == "password changed"
    assert retired["invalid_at"].endswith("Z") and retired["invalid_at"] >= retired["ts"]
    status, query_form = await api.call(
        "GET", "/api/v1/list", params={"user_id": user, "include_superseded": "true"}
    )
    assert query_form["total"] == 2


# --- delete --------------------------------------------------------------------------------


async def test_by_id_delete_of_another_owners_row_is_404_and_keeps_it(api: Api) -> None:
    alice, bob = _user(), _user()
    row = (await api.add("Alice's locker code is 4412.", alice))["memory_id"]
    for params in (
        {"id": row, "user_id": bob},
        {"id": row},
        {"id": row, "user_id": alice, "agent_id": "x"},
    ):
        status, body = await api.call("POST", "/api/v1/delete_all", json=params)
        assert status == 404, params
        assert body["deleted_count"] == 0 and body["error"]
    assert [m["memory_id"] for m in (await api.listing(alice))["memories"]] == [row]

    status, body = await api.call(
        "DELETE", "/api/v1/delete_all", params={"id": row, "user_id": alice}
    )
    assert (status, body) == (200, {"deleted_count": 1, "error": ""})
    assert (await api.listing(alice))["total"] == 0
    status, body = await api.call("POST", "/api/v1/delete_all", json={"id": row, "user_id": alice})
    assert status == 404


async def test_by_id_delete_honours_layer_and_refuses_all_and_keeps_the_row(api: Api) -> None:
    user = _user()
    row = (await api.add("Alice's bike lock code is 7301.", user))["memory_id"]
    for params, code in (
        ({"layer": "l3_fact"}, 404),
        ({"layer": "all"}, 400),
        ({"all": True}, 400),
        ({"confirm": "wipe-all"}, 400),
    ):
        status, body = await api.call(
            "POST", "/api/v1/delete_all", json={"id": row, "user_id": user, **params})
        assert status == code, (params, body)
        assert body["deleted_count"] == 0 and body["error"]
    assert [m["memory_id"] for m in (await api.listing(user))["memories"]] == [row]

    status, body = await api.call(
        "POST", "/api/v1/delete_all", json={"id": row, "user_id": user, "layer": "l2_raw"})
    assert (status, body) == (200, {"deleted_count": 1, "error": ""})
    assert (await api.listing(user))["total"] == 0


async def test_edit_stores_a_new_version_and_retires_the_old_one_as_replaced(api: Api) -> None:
    user = _user()
    old = (await api.add("I live in Porto", user, agent_id="phone"))["memory_id"]
    status, edited = await api.call("POST", "/api/v1/update", json={
        "id": old, "text": "I live in Lisbon", "user_id": user, "origin": "dashboard"})
    assert status == 200, edited
    new = edited["memory_id"]
    assert new != old and (edited["replaced"], edited["changed"]) == (old, True)
    rows = {m["memory_id"]: m for m in
            (await api.listing(user, include_superseded=True))["memories"]}
    assert rows[new]["content"] == "I live in Lisbon" and "invalid_at" not in rows[new]
    assert rows[new]["agent_id"] == "phone"
    assert (rows[old]["superseded_how"], rows[old]["superseded_by"]) == ("replaced", new)
    _, trail = await api.call("GET", "/api/v1/history", params={"id": old, "user_id": user})
    assert [(e["action"], e["actor"]) for e in trail["history"]] == [
        ("insert", "api"), ("retire", "dashboard")]
    _, trail = await api.call("GET", "/api/v1/history", params={"id": new, "user_id": user})
    assert [(e["action"], e["actor"]) for e in trail["history"]] == [("insert", "dashboard")]

    # A retired row is not edited; bad input is a 4xx and changes nothing.
    for body, code in (
        ({"id": old, "text": "I live in Faro"}, 409),
        ({"id": new, "text": "  "}, 400),
        ({"id": "no-such-id", "text": "x"}, 404),
        ({"id": new, "text": "I live in Faro", "user_id": _user()}, 404),
    ):
        status, reply = await api.call("POST", "/api/v1/update",
                                       json={"user_id": user, **body})
        assert status == code, (body, reply)
    assert len((await api.listing(user, include_superseded=True))["memories"]) == 2


async def test_an_edit_to_the_rows_own_text_changes_nothing(api: Api) -> None:
    user = _user()
    row = (await api.add("I live in Porto", user))["memory_id"]
    status, edited = await api.call("POST", "/api/v1/update",
                                    json={"id": row, "text": "I live in Porto", "user_id": user})
    assert status == 200, edited
    assert (edited["memory_id"], edited["replaced"], edited["changed"]) == (row, "", False)
    listed = (await api.listing(user, include_superseded=True))["memories"]
    assert [(m["memory_id"], "invalid_at" in m) for m in listed] == [(row, False)]
    _, trail = await api.call("GET", "/api/v1/history", params={"id": row, "user_id": user})
    assert [e["action"] for e in trail["history"]] == ["insert"]


async def test_an_edit_corrects_the_date_of_a_row_with_or_without_new_text(api: Api) -> None:
    user = _user()
    row = (await api.add("I moved to Lisbon", user, event_at="2026-03-14"))["memory_id"]

    async def edit(**fields: Any) -> tuple[int, Any]:
        return await api.call("POST", "/api/v1/update", json={"user_id": user, **fields})

    status, dated = await edit(id=row, event_at="2026-03-04")
    assert status == 200 and dated["changed"] and dated["replaced"] == row, dated
    status, again = await edit(id=dated["memory_id"], event_at="2026-03-04T00:00:00Z")
    assert status == 200 and not again["changed"], again
    status, both = await edit(id=dated["memory_id"], text="I moved to Lisbon on the 4th",
                              event_at=1772582400)  # 2026-03-04, as unix seconds
    assert status == 200 and both["changed"], both
    for body in ({"id": both["memory_id"], "event_at": "March 4th"},
                 {"id": both["memory_id"]}, {"id": both["memory_id"], "text": ""}):
        status, reply = await edit(**body)
        assert status == 400, (body, reply)
    live = [(m["content"], m["event_at"])
            for m in (await api.listing(user))["memories"]]
    assert live == [("I moved to Lisbon on the 4th", 1772582400)]
    listed = (await api.listing(user, include_superseded=True))["memories"]
    assert sorted(m["event_at"] for m in listed) == [1772582400, 1772582400, 1773446400]


async def test_two_edits_of_one_row_sent_at_once_leave_one_live_version(api: Api) -> None:
    user = _user()
    old = (await api.add("I live in Porto", user))["memory_id"]
    replies = await asyncio.gather(*(
        api.call("POST", "/api/v1/update", json={"id": old, "text": text, "user_id": user})
        for text in ("I live in Lisbon", "I live in Braga")
    ))
    assert sorted(status for status, _ in replies) == [200, 409], replies
    (kept,) = [body["memory_id"] for status, body in replies if status == 200]
    live = (await api.listing(user))["memories"]
    assert [m["memory_id"] for m in live] == [kept]
    rows = {m["memory_id"]: m for m in
            (await api.listing(user, include_superseded=True))["memories"]}
    assert len(rows) == 2 and rows[old]["superseded_by"] == kept


async def test_restoring_a_replaced_row_while_its_replacement_is_live_is_409(api: Api) -> None:
    user = _user()
    paris = (await api.add("I live in Paris", user))["memory_id"]
    _, edited = await api.call("POST", "/api/v1/update",
                               json={"id": paris, "text": "I live in Berlin", "user_id": user})
    berlin = edited["memory_id"]
    status, body = await api.call("POST", "/api/v1/restore", json={"id": paris, "user_id": user})
    assert status == 409, body
    assert f"its replacement {berlin!r} is live: forget or delete it first" in body["error"]
    assert [m["memory_id"] for m in (await api.listing(user))["memories"]] == [berlin]

    # Once the replacement is forgotten, the old row comes back.
    status, _ = await api.call("POST", "/api/v1/forget", json={"id": berlin, "user_id": user})
    assert status == 200
    status, body = await api.call("POST", "/api/v1/restore", json={"id": paris, "user_id": user})
    assert (status, body["restored"]) == (200, True)
    assert [m["memory_id"] for m in (await api.listing(user))["memories"]] == [paris]


async def test_owners_lists_users_and_their_agents_with_counts_and_last_write(api: Api) -> None:
    user = _user()
    first = (await api.add("Note one", user, agent_id="cli"))["memory_id"]
    await api.add("Note two", user, agent_id="cli")
    await api.add("Note three", user, agent_id="hermes")
    await api.call("POST", "/api/v1/update", json={"id": first, "text": "Note 1", "user_id": user})
    status, body = await api.call("GET", "/api/v1/owners", params={"user_id": user})
    assert status == 200, body
    (entry,) = body["users"]
    assert (entry["user_id"], entry["live"], entry["retired"]) == (user, 3, 1)
    # The agent written last comes first.
    assert [(a["agent_id"], a["live"], a["retired"]) for a in entry["agents"]] == [
        ("cli", 2, 1), ("hermes", 1, 0)]
    assert entry["last_write_at"].endswith("Z")
    status, everyone = await api.call("GET", "/api/v1/owners")
    assert status == 200 and user in [u["user_id"] for u in everyone["users"]]


async def test_bulk_delete_without_admin_is_403_and_deletes_nothing(api: Api) -> None:
    user = _user()
    await api.add("keep me", user)
    before = await api.total()
    for params in ({"user_id": user}, {"layer": "l2_raw"}, {"all": True}, {"confirm": "wipe-all"}):
        status, body = await api.call("POST", "/api/v1/delete_all", json=params)
        assert status == 403 and body["deleted_count"] == 0 and "HYATLAS_ADMIN" in body["error"]
    assert await api.total() == before
    assert (await api.listing(user))["total"] == 1


# --- status, metrics, flush ------------------------------------------------------------------


async def test_status_shows_mode_embed_model_and_layer_counts(
    api: Api, embedder_address: str
) -> None:
    async with open_channel(embedder_address) as channel:
        model = await EmbedderClient(channel).describe()
    status, before = await api.call("GET", "/api/v1/status")
    assert status == 200
    await api.add("status counter row", _user())
    status, body = await api.call("GET", "/api/v1/status")
    assert body["status"] == "ok" and body["version"] == "5.0.0-py"
    assert body["mode"] == "lite" and body["uses_llm"] is False
    assert body["llm"] == "unused" and body["extract_sync"] == "none (lite mode)"
    assert body["embed"] == model.model_id and body["embed_dims"] == model.ndim
    assert list(body["layers"]) == LAYERS
    assert body["layers"]["l2_raw"] == before["layers"]["l2_raw"] + 1
    assert body["vdb_points"] == sum(body["layers"].values())
    assert body["writes"] == before["writes"] + 1
    assert body["consolidations"] == -1 and body["unextracted"] == 0
    assert body["write_pipeline"] == "ok" and body["vdb"] == "ok"
    assert (body["graph_nodes"], body["graph_edges"]) == (0, 0)
    assert body["data_dir"]

    await api.call("POST", "/api/v1/search", json={"query": "status counter row"})
    status, after = await api.call("GET", "/api/v1/status")
    assert after["searches"] == body["searches"] + 1


async def test_metrics_counts_every_layer(api: Api) -> None:
    await api.add("metrics row", _user())
    status, body = await api.call("GET", "/api/v1/metrics")
    assert status == 200
    assert list(body["layers"]) == LAYERS
    assert body["total"] == sum(body["layers"].values()) and body["total"] >= 1
    assert (body["graph_nodes"], body["graph_edges"]) == (0, 0)


async def test_flush_reports_vectors(api: Api) -> None:
    await api.add("flush row", _user())
    status, body = await api.call("POST", "/api/v1/flush")
    assert status == 200
    assert body["flushed"] is True and body["vectors"] >= 1


async def test_graph_of_an_owner_without_edges_is_empty(api: Api) -> None:
    status, body = await api.call("GET", "/api/v1/graph", params={"node": "x", "user_id": _user()})
    assert status == 200
    assert (body["neighbors"], body["node_count"], body["edge_count"]) == ([], 0, 0)


# --- ultra with an LLM configured, admin and a token ----------------------------------------


async def test_token_guards_the_api_but_not_healthz(admin_api: Api) -> None:
    anonymous = Api(admin_api.base_url)
    assert await anonymous.call("GET", "/healthz") == (200, {"status": "ok"})
    status, body = await anonymous.call("GET", "/api/v1/status")
    assert status == 401
    status, body = await anonymous.call("POST", "/api/v1/add", json={"text": "sneaky"})
    assert status == 401 and body["success"] is False
    assert (await admin_api.call("GET", "/api/v1/status"))[0] == 200


async def test_ultra_with_llm_configured_queues_extraction(admin_api: Api) -> None:
    added = await admin_api.add("I start the new job on Monday.", _user())
    assert added["extraction_status"] == "pending"
    status, body = await admin_api.call("GET", "/api/v1/status")
    assert body["mode"] == "ultra" and body["uses_llm"] is True
    # This stack runs no extractor, which alone knows the LLM's state: the gateway does not guess.
    assert body["llm"] == "unknown" and body["write_pipeline"].startswith("degraded")
    assert body["llm_model"] == "scripted"
    assert body["llm_base"] == "http://127.0.0.1:9/v1"
    assert body["extract_sync"].startswith("background")
    assert body["consolidations"] == 0 and body["unextracted"] >= 1
    status, body = await admin_api.call("POST", "/api/v1/digest")
    # This stack runs no consolidator: the pass cannot start.
    assert status == 503 and body["digest_ok"] is False


async def test_admin_bulk_delete_removes_only_the_named_scope(admin_api: Api) -> None:
    alice, bob = _user(), _user()
    for n in range(2):
        await admin_api.add(f"alice note {n}", alice, agent_id="a1")
    await admin_api.add("alice other agent", alice, agent_id="a2")
    await admin_api.add("bob note", bob, agent_id="a1")

    status, body = await admin_api.call(
        "POST", "/api/v1/delete_all", json={"user_id": alice, "agent_id": "a1", "layer": "*"}
    )
    assert (status, body) == (200, {"deleted_count": 2, "error": ""})
    assert [m["content"] for m in (await admin_api.listing(alice))["memories"]] == [
        "alice other agent"
    ]
    assert (await admin_api.listing(bob))["total"] == 1

    status, body = await admin_api.call(
        "DELETE", "/api/v1/delete_all", params={"user_id": bob, "layer": "l2_raw"}
    )
    assert (status, body) == (200, {"deleted_count": 1, "error": ""})
    assert (await admin_api.listing(bob))["total"] == 0
    assert (await admin_api.listing(alice))["total"] == 1


async def test_pro_without_llm_reports_unconfigured(tmp_path: Path, embedder_address: str) -> None:
    with running_stack(
        tmp_path,
        ["store", "search", "extractor", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_MODE="pro",
    ) as stack:
        api = Api(stack.base_url)
        user = _user()
        added = await api.add("No model is configured here.", user)
        assert added["extraction_status"] == "unconfigured"
        # The extractor said so, and wrote it on the row.
        (row,) = (await api.listing(user))["memories"]
        assert row["extraction_status"] == "unconfigured"
        status, body = await api.call("GET", "/api/v1/status")
        assert body["llm"] == "unconfigured" and body["consolidations"] == -1
        # Still to be extracted once a model is set (catch-up takes it): counted.
        assert body["unextracted"] == 1
        assert body["extract_sync"].startswith("blocking")
        # A key alone would serve no call: refused, not kept.
        status, body = await api.call("POST", "/api/v1/llm/key", json={"key": "sk-alone"})
        assert status == 409 and "no LLM endpoint is configured" in body["error"], body
        assert (await api.call("GET", "/api/v1/status"))[1]["llm"] == "unconfigured"
        assert stack.procs["gateway"].stop() == 0  # SIGTERM: a clean stop, exit status 0


async def test_unextracted_leaves_out_turns_too_old_for_catch_up(
    tmp_path: Path, embedder_address: str
) -> None:
    with running_stack(
        tmp_path,
        ["store", "search", "extractor", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_MODE="pro",
        HYATLAS_CATCHUP_MAX_AGE="1s",
    ) as stack:
        api = Api(stack.base_url)
        added = await api.add("Written while no model was set.", _user())
        assert added["extraction_status"] == "unconfigured"

        async def too_old() -> None:
            assert (await api.call("GET", "/api/v1/status"))[1]["unextracted"] == 0

        # Past HYATLAS_CATCHUP_MAX_AGE catch-up never takes it: no longer counted.
        await assert_eventually(too_old)
        async with open_channel(stack.address("store")) as channel:
            stats = await store_pb2_grpc.StoreStub(channel).GetStats(
                store_pb2.GetStatsRequest(scope=common_pb2.Scope(all_users=True)), timeout=10)
        assert stats.unextracted == 1  # of any age


def test_the_gateway_runs_without_the_ranking_and_numpy() -> None:
    # The dashboard lists the search's switches from a module of names alone: the stages and
    # numpy would take about 20 MiB of the gateway's memory.
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, gateway.__main__; print(sorted(sys.modules))"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent,
    ).stdout
    assert "'numpy'" not in loaded and "'services.search.ranking'" not in loaded
    assert "'services.search.switches'" in loaded
