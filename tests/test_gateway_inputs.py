"""Bad client input through the running stack: a clear 4xx, never a 5xx, and nothing changed."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from yarl import URL

from gateway.errors import UNSUPPORTED_ENCODING, errors_middleware
from shared.clients import EmbedderClient
from shared.errors import Internal, InvalidArgument
from shared.limits import MAX_EMBED_CHARS, MAX_METADATA_BYTES, MAX_NAME_CHARS, MAX_TEXT_CHARS
from shared.rpc import open_channel
from tests.support import Stack, assert_eventually, running_stack, serving_http

pytestmark = pytest.mark.slow

TOKEN = "inputs-token"
USER = "inputs-user"
LONG_NAME = "n" * (MAX_NAME_CHARS + 1)
LONG_TEXT = "a" * (MAX_TEXT_CHARS + 1)
# The shapes the audit found giving 500 or 503, and the lengths it found accepted.
NESTED = '{"a":' * 5000 + "1" + "}" * 5000
SURROGATE = '"\\ud800"'
YEAR_10000 = "9999-12-31T23:59:59-23:59"
YEAR_0 = "0001-01-01T00:00:00+14:00"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    """A lite stack with a token: store, search and the gateway."""
    data_dir: Path = tmp_path_factory.mktemp("gateway-inputs")
    with running_stack(
        data_dir,
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_MODE="lite",
        HYATLAS_TOKEN=TOKEN,
    ) as running:
        yield running


@pytest.fixture
async def session(stack: Stack) -> AsyncIterator[aiohttp.ClientSession]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(stack.base_url, headers=headers) as client:
        yield client


@pytest.fixture(scope="module")
def row(stack: Stack) -> str:
    """One row of USER that every refused request must leave as it is."""
    request = urllib.request.Request(
        stack.base_url + "/api/v1/add",
        data=json.dumps({"text": "The lighthouse keeper's cat is called Biscuit.",
                         "user_id": USER}).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return str(json.load(reply)["memory_id"])


async def _call(
    session: aiohttp.ClientSession, method: str, path: str, **kw: Any
) -> tuple[int, Any]:
    async with session.request(method, path, **kw) as reply:
        text = await reply.text()
        assert reply.content_type == "application/json", text[:300]
        return reply.status, json.loads(text)


async def _state(session: aiohttp.ClientSession, row: str) -> Any:
    """What a refused request must not change: every owner's counts, the row and its history."""
    owners = await _call(session, "GET", "/api/v1/owners")
    total = await _call(session, "GET", "/api/v1/metrics")
    listed = await _call(session, "POST", "/api/v1/list", json={
        "user_id": USER, "include_superseded": True})
    history = await _call(session, "POST", "/api/v1/history", json={"id": row, "user_id": USER})
    return owners, total, listed, history


async def _refused(
    session: aiohttp.ClientSession, row: str, status: int, method: str, path: str, **kw: Any
) -> str:
    """Sends one bad request; asserts its status and that nothing changed; returns the error."""
    before = await _state(session, row)
    got, body = await _call(session, method, path, **kw)
    assert got == status, body
    assert isinstance(body["error"], str) and body["error"]
    assert await _state(session, row) == before
    return str(body["error"])


def _raw(body: str) -> dict[str, Any]:
    return {"data": body.encode(), "headers": {"Content-Type": "application/json"}}


# --- F3: one limit on text, answered 413 before anything is stored ---------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/add", {"text": LONG_TEXT, "user_id": USER}),
        ("/api/v1/add", {"data": LONG_TEXT, "user_id": USER}),
        ("/api/v1/search", {"query": LONG_TEXT, "user_id": USER}),
        ("/api/v1/forget", {"text": LONG_TEXT, "user_id": USER}),
        ("/api/v1/update", {"id": "$row", "text": LONG_TEXT, "user_id": USER}),
    ],
)
async def test_a_text_over_the_limit_is_413_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, path: str, body: dict[str, Any]
) -> None:
    body = {key: row if value == "$row" else value for key, value in body.items()}
    error = await _refused(session, row, 413, "POST", path, json=body)
    assert f"the limit is {MAX_TEXT_CHARS:,}" in error


@pytest.mark.parametrize(
    ("path", "body", "name"),
    [
        ("/api/v1/add", {"text": "a\x00b", "user_id": USER}, "text"),
        ("/api/v1/add", {"data": "a\x00b", "user_id": USER}, "data"),
        ("/api/v1/update", {"id": "$row", "text": "a\x00b", "user_id": USER}, "text"),
        ("/api/v1/add", {"text": "ok", "metadata": {"k": ["a\x00b"]}, "user_id": USER},
         "metadata"),
    ],
)
async def test_a_text_holding_a_nul_is_400_on_either_backend_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, path: str, body: dict[str, Any], name: str
) -> None:
    # SQLite would keep it, PostgreSQL cannot: refused alike, a store can move between them.
    body = {key: row if value == "$row" else value for key, value in body.items()}
    error = await _refused(session, row, 400, "POST", path, json=body)
    assert error == f"{name} may not hold a NUL character"


async def test_a_text_at_the_limit_is_stored_and_a_later_turn_still_embeds_with_it(
    session: aiohttp.ClientSession,
) -> None:
    # The store embeds a turn with its neighbours' text (a context key): a text at the limit
    # must still fit the embedder then.
    user = f"at-limit-{uuid.uuid4().hex[:6]}"
    words = ("word " * (MAX_TEXT_CHARS // 5))[:MAX_TEXT_CHARS]
    for text in (words, "a short turn after the long one", words):
        status, body = await _call(
            session, "POST", "/api/v1/add", json={"text": text, "user_id": user})
        assert status == 200, body
    status, body = await _call(session, "POST", "/api/v1/search", json={
        "query": words, "user_id": user})
    assert status == 200, body


async def test_metadata_over_its_limit_is_413_and_changes_nothing(
    session: aiohttp.ClientSession, row: str
) -> None:
    metadata = {"blob": "m" * MAX_METADATA_BYTES}
    error = await _refused(session, row, 413, "POST", "/api/v1/add", json={
        "text": "with big metadata", "user_id": USER, "metadata": metadata})
    assert f"the limit is {MAX_METADATA_BYTES:,}" in error


async def test_the_embedders_invalid_argument_stays_a_client_error(embedder_address: str) -> None:
    # A store or search that sends a text over the embedder's limit learns it is the text's
    # fault (InvalidArgument: 400), not that the embedder is away (Unavailable: 503).
    async with open_channel(embedder_address) as channel:
        with pytest.raises(InvalidArgument, match=f"at most {MAX_EMBED_CHARS}"):
            await EmbedderClient(channel).embed(["x" * (MAX_EMBED_CHARS + 1)])


# --- F11: names and ids have a length limit -------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/api/v1/add", {"text": "x", "user_id": LONG_NAME}),
        ("POST", "/api/v1/add", {"text": "x", "user_id": USER, "agent_id": LONG_NAME}),
        ("POST", "/api/v1/add", {"text": "x", "user_id": USER, "session_id": LONG_NAME}),
        ("POST", "/api/v1/add", {"text": "x", "user_id": USER,
                                 "metadata": {"session_id": LONG_NAME}}),
        ("POST", "/api/v1/list", {"user_id": LONG_NAME}),
        ("POST", "/api/v1/list", {"user_id": USER, "layer": LONG_NAME}),
        ("POST", "/api/v1/search", {"query": "cat", "user_id": USER, "reader": LONG_NAME}),
        ("POST", "/api/v1/history", {"id": LONG_NAME, "user_id": USER}),
        ("POST", "/api/v1/delete_all", {"id": LONG_NAME, "user_id": USER}),
        ("POST", "/api/v1/feedback", {"memory_ids": [LONG_NAME], "user_id": USER}),
        ("POST", "/api/v1/restore", {"id": LONG_NAME, "user_id": USER}),
        ("GET", f"/api/v1/export?user_id={LONG_NAME}", None),
        ("GET", f"/dashboard/api/memory?id=x&user_id={LONG_NAME}", None),
        ("GET", f"/dashboard/api/memory?id={LONG_NAME}", None),
    ],
)
async def test_a_name_or_id_over_its_limit_is_400_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, method: str, path: str, body: Any
) -> None:
    error = await _refused(session, row, 400, method, path, json=body)
    assert f"at most {MAX_NAME_CHARS}" in error
    assert LONG_NAME not in error  # the error names the parameter, it does not echo it


async def test_a_name_at_its_limit_is_accepted(session: aiohttp.ClientSession) -> None:
    user = "u" * MAX_NAME_CHARS
    status, body = await _call(session, "POST", "/api/v1/add", json={
        "text": "a long but allowed owner", "user_id": user, "agent_id": "a" * MAX_NAME_CHARS})
    assert status == 200, body
    status, listed = await _call(session, "POST", "/api/v1/list", json={"user_id": user})
    assert status == 200 and listed["total"] == 1


# --- F4a, F4b: nested JSON and lone surrogates ----------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/api/v1/list", NESTED),
        ("/api/v1/add", NESTED),
        ("/api/v1/add", '{"text": "x", "metadata": ' + '{"a":' * 40 + "1" + "}" * 40 + "}"),
        ("/api/v1/search", '{"query": "x", "skip_stages": ' + "[" * 40 + "]" * 40 + "}"),
    ],
)
async def test_deeply_nested_json_is_400_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, path: str, raw: str
) -> None:
    error = await _refused(session, row, 400, "POST", path, **_raw(raw))
    assert "nested over 32 levels" in error


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/api/v1/add", '{"text": ' + SURROGATE + "}"),
        ("/api/v1/add", '{"text": "x", "user_id": ' + SURROGATE + "}"),
        ("/api/v1/add", '{"text": "x", "metadata": {"a": [{"b": ' + SURROGATE + "}]}}"),
        ("/api/v1/add", '{"text": "x", "metadata": {' + SURROGATE + ": 1}}"),
        ("/api/v1/search", '{"query": "x", "skip_stages": [' + SURROGATE + "]}"),
        ("/api/v1/forget", '{"text": ' + SURROGATE + "}"),
        ("/api/v1/update", '{"id": "x", "text": ' + SURROGATE + "}"),
        ("/api/v1/list", '{"user_id": "a\\udfffb"}'),
    ],
)
async def test_a_lone_surrogate_anywhere_in_the_body_is_400_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, path: str, raw: str
) -> None:
    error = await _refused(session, row, 400, "POST", path, **_raw(raw))
    assert "not valid Unicode" in error


async def test_a_body_that_is_not_utf8_is_400_and_changes_nothing(
    session: aiohttp.ClientSession, row: str
) -> None:
    # UTF-16 carries a lone surrogate as a bare code unit, without any \\u escape.
    body = '{"text": "\ud800", "user_id": "utf16"}'.encode("utf-16", "surrogatepass")
    error = await _refused(session, row, 400, "POST", "/api/v1/add", data=body,
                           headers={"Content-Type": "application/json"})
    assert error == "bad body"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.parametrize("path", ["/api/v1/add", "/api/v1/import"])
async def test_a_body_that_does_not_decode_as_its_content_encoding_is_400_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, path: str, encoding: str
) -> None:
    body = json.dumps({"text": "x", "user_id": USER}).encode()
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    error = await _refused(session, row, 400, "POST", path, data=body, headers=headers)
    assert error.startswith("bad body: ") and encoding in error


async def test_a_body_that_does_not_decode_logs_no_error(
    stack: Stack, session: aiohttp.ClientSession
) -> None:
    # After the 400, aiohttp reads what is left of the body and meets the bad bytes again: the
    # gateway says so at info level, not as an unhandled exception with a traceback.
    log_path = stack.data_dir / "gateway.log"
    seen = log_path.read_text().count("request body does not decode")
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    status, _ = await _call(session, "POST", "/api/v1/add", data=b"not gzip", headers=headers)
    assert status == 400

    def logged() -> None:
        assert log_path.read_text().count("request body does not decode") > seen

    await assert_eventually(logged)
    assert "Unhandled exception" not in log_path.read_text()


@pytest.mark.parametrize("encoding", ["bogus", "x-gzip", "gzip, gzip", "compress"])
async def test_a_body_in_an_encoding_the_gateway_does_not_know_is_415_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, encoding: str
) -> None:
    # aiohttp would hand such a body on as it is, read as if unencoded.
    body = json.dumps({"text": "x", "user_id": USER}).encode()
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    error = await _refused(session, row, 415, "POST", "/api/v1/add", data=body, headers=headers)
    assert error == UNSUPPORTED_ENCODING


async def test_a_body_said_to_be_unencoded_is_read(session: aiohttp.ClientSession) -> None:
    body = json.dumps({"text": "Marta grows basil on the balcony.", "user_id": USER}).encode()
    headers = {"Content-Type": "application/json", "Content-Encoding": "Identity"}
    status, reply = await _call(session, "POST", "/api/v1/add", data=body, headers=headers)
    assert status == 200 and reply["memory_id"], reply


# aiohttp's parser refuses these before any middleware runs (no decoder package is installed).
@pytest.mark.skipif(HAS_BROTLI or HAS_ZSTD, reason="a br or zstd decoder is installed")
@pytest.mark.parametrize("encoding", ["br", "zstd"])
@pytest.mark.parametrize("path", ["/api/v1/add", "/api/v1/import"])
async def test_a_body_in_an_encoding_no_decoder_reads_is_415_in_json_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, path: str, encoding: str
) -> None:
    body = json.dumps({"text": "x", "user_id": USER}).encode()
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    error = await _refused(session, row, 415, "POST", path, data=body, headers=headers)
    assert error == UNSUPPORTED_ENCODING and "gzip or deflate" in error


async def test_a_header_over_the_parsers_limit_is_400_in_json_and_changes_nothing(
    session: aiohttp.ClientSession, row: str
) -> None:
    headers = {"Content-Type": "application/json", "X-Long": "a" * 9000}
    body = json.dumps({"text": "x", "user_id": USER}).encode()
    error = await _refused(session, row, 400, "POST", "/api/v1/add", data=body, headers=headers)
    assert error.startswith("bad request: Got more than 8190 bytes")


# --- F4c: dashboard paths --------------------------------------------------------------------


@pytest.mark.parametrize(
    "tail", ["%00", "a%00b.js", "%00%2F..%2Findex.html", "%ED%A0%80", "%FF", "a" * 300]
)
async def test_an_undecodable_or_nul_dashboard_path_is_404(
    session: aiohttp.ClientSession, row: str, tail: str
) -> None:
    before = await _state(session, row)
    # Sent as it is written: already percent-encoded, not quoted again.
    async with session.get(URL("/dashboard/" + tail, encoded=True)) as reply:
        assert reply.status == 404, await reply.text()
        assert "not found" in (await reply.json())["error"]
    assert await _state(session, row) == before


# --- F4d: dates are range-checked before they are stored or used ------------------------------


@pytest.mark.parametrize(
    ("method", "path", "kw"),
    [
        ("POST", "/api/v1/add", {"json": {"text": "x", "user_id": USER, "event_at": YEAR_10000}}),
        ("POST", "/api/v1/add", {"json": {"text": "x", "user_id": USER, "event_at": YEAR_0}}),
        ("POST", "/api/v1/add", {"json": {"text": "x", "user_id": USER, "event_at": "1969-12-31"}}),
        ("POST", "/api/v1/add", {"json": {"text": "x", "user_id": USER, "event_at": -1}}),
        ("POST", "/api/v1/add", {"json": {"text": "x", "user_id": USER, "event_at": "1e400"}}),
        ("POST", "/api/v1/search", {"json": {"query": "x", "reference_time": YEAR_10000}}),
        ("POST", "/api/v1/search", {"json": {"query": "x", "reference_time": YEAR_0}}),
        ("GET", "/api/v1/graph-as-of", {"params": {"ts": YEAR_10000}}),
    ],
)
async def test_a_date_outside_the_calendar_is_400_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, method: str, path: str, kw: dict[str, Any]
) -> None:
    error = await _refused(session, row, 400, method, path, **kw)
    assert "must lie between 1970-01-01T00:00:00Z and 9999-12-31T23:59:59Z" in error


@pytest.mark.parametrize(
    ("method", "path", "kw", "name", "given"),
    [
        ("GET", "/api/v1/graph-as-of", {"params": {"ts": "NaN"}}, "ts", "NaN"),
        ("GET", "/api/v1/graph-as-of", {"params": {"ts": "-inf"}}, "ts", "-inf"),
        ("GET", "/api/v1/graph-as-of", {"params": {"ts": "last tuesday"}}, "ts", "last tuesday"),
        ("POST", "/api/v1/add", {"json": {"text": "x", "user_id": USER, "event_at": "nan"}},
         "event_at", "nan"),
    ],
)
async def test_a_date_that_is_no_date_is_400_naming_the_parameter_and_what_it_takes(
    session: aiohttp.ClientSession,
    row: str,
    method: str,
    path: str,
    kw: dict[str, Any],
    name: str,
    given: str,
) -> None:
    # "NaN" once read as a number, refused as "ts is out of range" (the Graph view sent it
    # for a hand-edited as_of).
    error = await _refused(session, row, 400, method, path, **kw)
    assert error == f"{name} must be unix seconds or an RFC3339 / ISO date string, got {given!r}"


@pytest.mark.parametrize(
    ("query", "reference_time"),
    [
        ("what happened next year", "9999-12-31T23:59:59Z"),
        ("what happened last year", "1970-01-01"),
        ("something 99999999 years ago", None),
        ("something 9999999999 days ago", None),
    ],
)
async def test_a_query_date_past_the_calendar_searches_as_naming_none(
    session: aiohttp.ClientSession, row: str, query: str, reference_time: str | None
) -> None:
    body: dict[str, Any] = {"query": query, "user_id": USER}
    if reference_time is not None:
        body["reference_time"] = reference_time
    status, reply = await _call(session, "POST", "/api/v1/search", json=body)
    assert status == 200, reply


# --- F2: an unexpected failure tells the client only its reference ---------------------------


async def _failing(request: web.Request) -> web.Response:
    if request.query.get("how") == "service":
        # What a backing service's unexpected failure may carry in its status details.
        raise Internal("store: Unexpected <class 'KeyError'>: 'secret-row-text'")
    raise RuntimeError("secret-row-text")


@pytest.mark.parametrize("how", ["service", "gateway"])
async def test_an_unexpected_failure_replies_with_a_reference_and_logs_the_rest(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = web.Application(middlewares=[errors_middleware])
    app.router.add_get("/fail", _failing)
    async with serving_http(app) as url:
        with caplog.at_level(logging.ERROR, logger="gateway.errors"):
            async with (
                aiohttp.ClientSession() as client,
                client.get(f"{url}/fail", params={"how": how}) as reply,
            ):
                status, body = reply.status, await reply.json()
    assert status == 500
    assert "secret" not in body["error"]
    assert body["error"].startswith("internal error (id ")
    reference = body["error"].removeprefix("internal error (id ").removesuffix(")")
    logged = [r for r in caplog.records if reference in r.getMessage()]
    assert logged, caplog.text
    assert "secret-row-text" in caplog.text


@pytest.mark.parametrize(
    ("memory", "needle"),
    [
        ({"user_id": LONG_NAME, "content": "x"}, "memory.user_id has 257 characters; at most 256"),
        ({"user_id": USER, "agent_id": LONG_NAME, "content": "x"}, "memory.agent_id has 257"),
        ({"user_id": USER, "content": LONG_TEXT},
         "memory.content has 100,001 characters; the limit is 100,000"),
        ({"user_id": USER, "content": "x", "metadata": {"x": "y" * 200_000}},
         "memory.metadata is 200,008 bytes as JSON; the limit is 65,536"),
        ({"user_id": USER, "content": "a\x00b"},
         "line 1: memory.content may not hold a NUL character"),
        ({"user_id": USER, "content": "x", "id": LONG_NAME}, "is not a usable id"),
        ({"user_id": USER, "content": "x", "event_at": 1e300},
         "memory.event_at is not between the years 1 and 9999"),
        ({"user_id": USER, "content": "x", "created_at": -62135596801},
         "memory.created_at is not between the years 1 and 9999"),
    ],
)
async def test_an_imported_line_over_a_limit_is_refused_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, memory: dict[str, Any], needle: str
) -> None:
    line = json.dumps({"type": "memory", "memory": memory})
    error = await _refused(session, row, 400, "POST", "/api/v1/import", data=line.encode())
    assert needle in error
    assert LONG_NAME not in error


# --- numbers a store cannot hold, and other shapes a second audit found giving 500 -----------

HUGE_INT = "1" + "0" * 400


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/api/v1/add", '{"text": "x", "event_at": ' + HUGE_INT + "}"),
        ("/api/v1/add", '{"text": "x", "metadata": {"n": 1e999}}'),
        ("/api/v1/add", '{"text": "x", "metadata": {"n": -' + HUGE_INT + "}}"),
        ("/api/v1/search", '{"query": "x", "min_score": ' + HUGE_INT + "}"),
        ("/api/v1/search", '{"query": "x", "reference_time": -1e999}'),
    ],
)
async def test_a_number_beyond_what_a_store_holds_is_400_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, path: str, raw: str
) -> None:
    error = await _refused(session, row, 400, "POST", path, **_raw(raw))
    assert "range" in error


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("[" * 100_000, "not JSON: nested deeper"),
        ('{"type": "memory", "memory": {"user_id": "u", "content": "x", "metadata": {"n": 1e999}}}',
         "beyond a number's range"),
        # Deep enough to parse, and then to fail every page that shows the row.
        ('{"type": "memory", "memory": {"user_id": "u", "content": "x", "metadata": '
         + '{"a":' * 500 + "1" + "}" * 500 + "}}",
         "line 1: memory.metadata is nested over 32 levels deep"),
    ],
)
async def test_an_import_line_nested_too_deep_or_out_of_range_is_400_and_changes_nothing(
    session: aiohttp.ClientSession, row: str, line: str, needle: str
) -> None:
    error = await _refused(session, row, 400, "POST", "/api/v1/import", data=line.encode())
    assert needle in error


async def test_a_token_that_is_not_utf8_is_401(stack: Stack) -> None:
    url = URL(stack.base_url)
    reader, writer = await asyncio.open_connection(url.host, url.port)
    writer.write(
        b"GET /api/v1/status HTTP/1.1\r\nHost: " + f"{url.host}:{url.port}".encode()
        + b"\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n"
    )
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    assert status_line.split()[1] == b"401", status_line

