"""Secrets kept out of sight, delete that erases, key hand-over behind proxies, slow clients,
private files, and bulk delete clearing the vector index: all through running services."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.store.disk_reserve import RESERVE_NAME
from shared.errors import ConfigError
from shared.pb import extractor_pb2, extractor_pb2_grpc, store_pb2
from shared.redact import redact_text, redact_url, shown_setting
from shared.rpc import open_channel
from shared.settings import Settings
from tests.llm_fake import ERROR, FakeLlm, fake_llm_in_thread
from tests.store_state import LONG_TEXT, apply, call, insert
from tests.support import WAIT_CEILING_S, Stack, assert_eventually, running_stack

pytestmark = pytest.mark.slow

PASSWORD = "S3cretPw-x9q"
# A token no tokenizer splits or stems, and no other text holds.
UNIQUE = "zqx7k2v9"
FORWARDING_HEADERS = [
    "Forwarded",
    "X-Forwarded-For",
    "X-Forwarded-Host",
    "X-Forwarded-Proto",
    "X-Real-IP",
    "X-Client-IP",
    "True-Client-IP",
    "CF-Connecting-IP",
    "X-Original-Forwarded-For",
    "X-Cluster-Client-IP",
    "Fastly-Client-IP",
    "Via",
    "Client-IP",
]


def _user() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


def _with_userinfo(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://hyuser:{PASSWORD}@{rest}"


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeLlm]:
    with fake_llm_in_thread() as fake:
        fake.default = ERROR
        yield fake


@pytest.fixture(scope="module")
def pro(
    tmp_path_factory: pytest.TempPathFactory, embedder_address: str, fake: FakeLlm
) -> Iterator[Stack]:
    """Pro mode with an LLM whose URL carries a password, and which always fails."""
    data_dir: Path = tmp_path_factory.mktemp("hardening-pro")
    with running_stack(
        data_dir,
        ["store", "search", "extractor", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_MODE="pro",
        HYATLAS_SYNC_EXTRACT="off",
        HYATLAS_LLM_BASE=_with_userinfo(fake.url),
        HYATLAS_LLM_MODEL="primary",
        HYATLAS_LLM_KEY="k",
        HYATLAS_EXTRACT_TIMEOUT="30s",
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def lite(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    """Lite mode with admin on, started on a data directory an older version left open."""
    data_dir: Path = tmp_path_factory.mktemp("hardening-lite")
    data_dir.chmod(0o755)
    (data_dir / "vectors").mkdir(mode=0o755)
    (data_dir / "vectors").chmod(0o755)
    (data_dir / "notes.txt").write_text("left by an older version")
    (data_dir / "notes.txt").chmod(0o644)
    with running_stack(
        data_dir,
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_ADMIN="on",
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def impatient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The gateway alone, with short header and body timeouts."""
    data_dir: Path = tmp_path_factory.mktemp("hardening-timeouts")
    with running_stack(
        data_dir, ["gateway"], HYATLAS_HEADER_TIMEOUT="2s", HYATLAS_BODY_TIMEOUT="2s"
    ) as stack:
        yield stack


def _file_bytes(data_dir: Path) -> bytes:
    """The database with its write-ahead log, as they are on disk."""
    return b"".join(
        path.read_bytes()
        for path in (data_dir / "hyatlas.db", data_dir / "hyatlas.db-wal")
        if path.exists()
    )


# --- F7: secrets ---------------------------------------------------------------------------


def test_redaction_hides_passwords_query_secrets_and_secret_settings() -> None:
    assert redact_url("http://u:pw@host:8/v1?model=m&api_key=abc") == (
        "http://u:***@host:8/v1?model=m&api_key=***"
    )
    assert redact_url("https://ghp_token@host/x") == "https://***@host/x"
    assert redact_url("http://host/v1") == "http://host/v1"
    assert redact_text("failed: GET postgres://me:pw@db/x?token=t (refused)") == (
        "failed: GET postgres://me:***@db/x?token=*** (refused)"
    )
    assert shown_setting("HYATLAS_EMBED_KEY", "k") == "(set)"
    assert shown_setting("llm_key_file", "") == "(not set)"
    assert shown_setting("token", "t") == "(set)"
    assert shown_setting("llm_base", "http://a:b@h/v1") == "http://a:***@h/v1"
    assert shown_setting("embed_threads", 2) == 2


async def test_status_dashboard_and_logs_never_show_the_llm_urls_password(
    pro: Stack, fake: FakeLlm
) -> None:
    status, added = await call(
        pro, "POST", "/api/v1/add", json={"text": "I moved to Lisbon in May.", "user_id": _user()}
    )
    assert status == 200, added
    extractor_log = pro.data_dir / "extractor.log"

    def llm_call_failed() -> None:
        assert "llm primary at" in extractor_log.read_text(errors="replace")

    await assert_eventually(llm_call_failed)
    assert fake.requests  # the URL was really used, password and all

    status, body = await call(pro, "GET", "/api/v1/status")
    assert status == 200, body
    assert body["llm_base"] == redact_url(_with_userinfo(fake.url))
    assert "hyuser:***@" in body["llm_base"]
    status, system = await call(pro, "GET", "/dashboard/api/system")
    assert status == 200, system
    assert system["settings"]["llm_base"] == body["llm_base"]
    assert system["settings"]["llm_key"] == "(set)"
    async with open_channel(pro.address("extractor")) as channel:
        llm = await extractor_pb2_grpc.ExtractorStub(channel).GetLlmStatus(
            extractor_pb2.GetLlmStatusRequest(), timeout=WAIT_CEILING_S
        )
    assert llm.llm_base == body["llm_base"]
    for shown in (json.dumps(body), json.dumps(system), llm.write_pipeline):
        assert PASSWORD not in shown
    for log in pro.data_dir.glob("*.log"):
        assert PASSWORD not in log.read_text(errors="replace"), log.name


# --- F9: the key hand-over behind a proxy ----------------------------------------------------


@pytest.mark.parametrize("header", FORWARDING_HEADERS)
async def test_key_hand_over_refuses_any_forwarding_header(pro: Stack, header: str) -> None:
    status, body = await call(
        pro, "POST", "/api/v1/llm/key", json={"key": "k-proxied"}, headers={header: "10.1.2.3"}
    )
    assert (status, body) == (403, {"error": "the LLM key is accepted only from this machine"})


async def test_key_hand_over_from_this_machine_is_taken(pro: Stack) -> None:
    status, body = await call(pro, "POST", "/api/v1/llm/key", json={"key": "k-local"})
    assert status == 200 and body["ok"] is True, body


# --- F8: delete erases ---------------------------------------------------------------------


async def test_delete_leaves_no_trace_of_the_text_in_history_or_the_database(
    lite: Stack,
) -> None:
    user = _user()
    ids = []
    for text in (
        "We talked about the garden first.",
        f"erase-me {UNIQUE} my number is 078-05-1120",
        "Then we planned the trip to Porto.",
    ):
        status, added = await call(
            lite, "POST", "/api/v1/add", json={"text": text, "user_id": user, "session_id": "s1"}
        )
        assert status == 200, added
        ids.append(added["memory_id"])
    secret = ids[1]
    # Earlier versions, metadata and a reason that all hold the text.
    await apply(
        lite,
        user,
        store_pb2.Op(
            update=store_pb2.UpdateOp(
                id=secret,
                content=f"erase-me {UNIQUE} my number is 078-05-1120, corrected",
                metadata_json=json.dumps({"note": f"{UNIQUE} in metadata"}),
            )
        ),
    )
    await apply(
        lite,
        user,
        store_pb2.Op(
            retire=store_pb2.RetireOp(
                id=secret, superseded_how="forgotten", drop_reason=f"forget {UNIQUE}"
            )
        ),
    )
    await apply(lite, user, store_pb2.Op(restore=store_pb2.RestoreOp(id=secret)))
    assert UNIQUE.encode() in _file_bytes(lite.data_dir)

    status, body = await call(
        lite, "POST", "/api/v1/delete_all", json={"id": secret, "user_id": user}
    )
    assert (status, body) == (200, {"deleted_count": 1, "error": ""})

    status, history = await call(
        lite, "POST", "/api/v1/history", json={"id": secret, "user_id": user}
    )
    assert status == 200, history
    entries = history["history"]
    assert [e["action"] for e in entries] == ["insert", "update", "retire", "restore", "delete"]
    assert all(e["actor"] and e["at"] for e in entries)
    assert entries[-1]["before"]["id"] == secret and entries[-1]["before"]["user_id"] == user
    assert UNIQUE not in json.dumps(history) and "078-05-1120" not in json.dumps(history)
    assert "content" not in entries[0]["after"] and "metadata" not in entries[1]["after"]

    status, found = await call(
        lite, "POST", "/api/v1/search", json={"query": f"erase-me {UNIQUE}", "user_id": user}
    )
    assert status == 200, found
    assert UNIQUE not in json.dumps(found)
    files = _file_bytes(lite.data_dir)
    assert UNIQUE.encode() not in files
    assert b"078-05-1120" not in files
    # The turns beside it keep their own text.
    assert b"trip to Porto" in files and b"the garden first" in files


# --- F15 (and F8 for bulk): admin bulk delete --------------------------------------------------


async def test_bulk_delete_takes_clause_keys_out_of_the_vectors_an_index_is_built_from(
    lite: Stack,
) -> None:
    """A small user's vector index is built from SQLite's keys when it loads: after a bulk
    delete only the fact's key is left there, and the deleted text is nowhere on the disk."""
    user = _user()
    status, added = await call(
        lite, "POST", "/api/v1/add", json={"text": f"{LONG_TEXT} {UNIQUE}-bulk", "user_id": user}
    )
    assert status == 200, added
    (fact,) = await apply(lite, user, insert(user, "l3_fact", "The user likes green tea."))
    db = sqlite3.connect(f"file:{lite.data_dir / 'hyatlas.db'}?mode=ro", uri=True)
    keys_of_user = (
        "SELECT v.key FROM vectors v JOIN memories m ON m.id = v.memory_id WHERE m.user_id = ? "
        "UNION ALL SELECT mk.key FROM memory_keys mk JOIN memories m ON m.id = mk.memory_id "
        "WHERE m.user_id = ? AND mk.vector IS NOT NULL"
    )
    try:
        clause_keys = db.execute(
            "SELECT count(*) FROM memory_keys WHERE memory_id = ? AND vector IS NOT NULL",
            (added["memory_id"],),
        ).fetchone()[0]
        assert clause_keys >= 2  # the long text is also indexed by its sentences

        status, body = await call(
            lite, "POST", "/api/v1/delete_all", json={"user_id": user, "layer": "l2_raw"}
        )
        assert (status, body) == (200, {"deleted_count": 1, "error": ""})
        status, flushed = await call(lite, "POST", "/api/v1/flush")
        assert status == 200, flushed

        (fact_key,) = db.execute(
            "SELECT key FROM vectors WHERE memory_id = ?", (fact.id,)
        ).fetchone()
        assert db.execute(keys_of_user, (user, user)).fetchall() == [(fact_key,)]
    finally:
        db.close()
    assert f"{UNIQUE}-bulk".encode() not in _file_bytes(lite.data_dir)


# --- F13: file modes -------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


async def test_data_directory_files_and_sockets_are_private(lite: Stack) -> None:
    status, added = await call(
        lite, "POST", "/api/v1/add", json={"text": "A private note.", "user_id": _user()}
    )
    assert status == 200, added
    status, flushed = await call(lite, "POST", "/api/v1/flush")
    assert status == 200, flushed
    data_dir = lite.data_dir
    for folder in (data_dir, data_dir / "vectors", data_dir / "run"):
        assert _mode(folder) == 0o700, folder
    files = [data_dir / "hyatlas.db", data_dir / "notes.txt", data_dir / RESERVE_NAME]
    for path in files:
        assert _mode(path) == 0o600, path
    sockets = list((data_dir / "run").glob("*.sock"))
    assert {path.name for path in sockets} >= {"store.sock", "search.sock"}
    for path in sockets:
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert _mode(path) & 0o077 == 0, path


# --- F12: slow clients ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["off", "0"])
def test_a_read_timeout_cannot_be_turned_off(value: str) -> None:
    with pytest.raises(ConfigError, match="HYATLAS_BODY_TIMEOUT"):
        Settings.from_env({"HYATLAS_BODY_TIMEOUT": value})


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), WAIT_CEILING_S)


async def test_a_connection_that_sends_half_its_headers_is_closed(impatient: Stack) -> None:
    port = int(impatient.env["HYATLAS_GO_PORT"])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /api/v1/add HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: applic")
        await writer.drain()
        assert await _until_closed(reader) == b""
    finally:
        writer.close()


@pytest.mark.parametrize(
    "request_start",
    [
        pytest.param(
            b"POST /api/v1/add HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"text\": ",
            id="a body that never arrives",
        ),
        pytest.param(
            b"POST /api/v1/import HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"typ\r\n",
            id="an import stream that stalls",
        ),
    ],
)
async def test_a_stalled_body_gets_408_and_the_connection_is_closed(
    impatient: Stack, request_start: bytes
) -> None:
    port = int(impatient.env["HYATLAS_GO_PORT"])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_start)
        await writer.drain()
        sent = await _until_closed(reader)
    finally:
        writer.close()
    head, _, body = sent.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), sent
    assert json.loads(body)["error"] == "request body not received within 2s"


async def test_a_body_whose_chunked_framing_breaks_is_refused_at_once(impatient: Stack) -> None:
    # Past the first read of the connection, so the route is reading the body when it breaks;
    # until 2026-12-07 it waited for the rest until the body timeout (a 408).
    start = b'{"user_id": "u", "text": "' + b"x" * (2 << 20)
    port = int(impatient.env["HYATLAS_GO_PORT"])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /api/v1/add HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(start) + start + b"\r\nzz\r\n"
        )
        await writer.drain()
        sent = await _until_closed(reader)
    finally:
        writer.close()
    head, _, body = sent.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), sent
    assert json.loads(body)["error"] == "bad body: Invalid character in chunk size"


async def test_a_whole_request_is_answered_as_usual(impatient: Stack) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(impatient.base_url + "/healthz") as reply,
    ):
        body: Any = await reply.json()
    assert (reply.status, body) == (200, {"status": "ok"})

