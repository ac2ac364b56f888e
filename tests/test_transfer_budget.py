"""Export and import past gRPC's message limit: an in-process store and gateway, with the limit
and the transfer budgets lowered so a few large memories reach them."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import make_app
from gateway.config import GatewayConfig
from gateway.parser_errors import AppRunner
from gateway.routes import transfer as gateway_transfer
from hyatlas_cli.client import Gateway, GatewayError
from services.store import transfer as store_transfer
from services.store.server import running_server
from shared import rpc
from shared.settings import Settings
from tests.store_state import store_config
from tests.support import WAIT_CEILING_S

MESSAGE_BYTES = 256 * 1024
BUDGET_BYTES = 64 * 1024
LINE_BYTES = 128 * 1024
TEXT = "The lighthouse keeper writes the weather down every evening. " * 300  # 18 KB


@pytest.fixture
async def gateway_app(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    embedder_address: str,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[web.Application]:
    """A gateway and store whose calls carry at most MESSAGE_BYTES, as 64 MiB would; a test
    may pass the gateway's settings (indirect parametrization)."""
    monkeypatch.setattr(rpc, "CHANNEL_OPTIONS", [
        ("grpc.max_send_message_length", MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MESSAGE_BYTES),
    ])
    for module in (store_transfer, gateway_transfer):
        monkeypatch.setattr(module, "TRANSFER_BUDGET_BYTES", BUDGET_BYTES)
        monkeypatch.setattr(module, "MAX_TRANSFER_LINE_BYTES", LINE_BYTES)
    config = store_config(tmp_path, embedder_address)
    async with running_server(config) as address:
        gateway_config = GatewayConfig(
            store_address=address,
            search_address=f"unix:{tmp_path / 'search.sock'}",
            mode="lite",
            rpc_timeout_s=30.0,
            **getattr(request, "param", {}),
        )
        settings = Settings(data_dir=tmp_path, run_dir=tmp_path / "run")
        yield make_app(gateway_config, settings)


@pytest.fixture
async def gateway(gateway_app: web.Application) -> AsyncIterator[TestClient[Any, Any]]:
    """That gateway served over HTTP."""
    client = TestClient(TestServer(gateway_app, host="127.0.0.1"))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def _model(client: TestClient[Any, Any]) -> str:
    async with client.get("/api/v1/export", params={"user_id": "nobody"}) as reply:
        assert reply.status == 200, await reply.text()
        head: str = json.loads((await reply.text()).splitlines()[0])["model_id"]
        return head


def _line(user: str, n: int, model: str, text: str = TEXT) -> str:
    vector = np.random.default_rng(n).standard_normal(384).astype("<f4")
    vector /= np.linalg.norm(vector)
    entry = {"at": 1.0, "actor": "api", "action": "insert", "reason": "", "before": None,
             "after": {"content": text}}
    return json.dumps({
        "type": "memory",
        "memory": {"user_id": user, "id": f"{user}-{n}", "content": f"{n} {text}"},
        "vector": base64.b64encode(vector.tobytes()).decode(),
        "model_id": model,
        "keys": [],
        "history": [entry],
    })


async def _import(client: TestClient[Any, Any], lines: list[str]) -> tuple[int, Any]:
    body = "".join(line + "\n" for line in lines).encode()
    async with client.post("/api/v1/import", data=body) as reply:
        return reply.status, await reply.json()


async def test_memories_past_the_message_limit_import_and_export_in_smaller_calls(
    gateway: TestClient[Any, Any],
) -> None:
    model = await _model(gateway)
    lines = [_line("keeper", n, model) for n in range(12)]  # 36 KB each, 440 KB in all
    assert sum(len(line) for line in lines) > MESSAGE_BYTES
    status, reply = await _import(gateway, lines)
    assert status == 200, reply
    assert (reply["imported"], reply["refused"]) == (12, 0)

    async with gateway.get("/api/v1/export", params={"user_id": "keeper"}) as answer:
        assert answer.status == 200
        exported = [json.loads(line) for line in (await answer.text()).splitlines()[1:-1]]
    assert [line["memory"]["id"] for line in exported] == [f"keeper-{n}" for n in range(12)]
    assert all(line["history"][0]["after"]["content"] == TEXT for line in exported)


async def test_a_line_too_large_for_one_call_is_a_413_naming_it(
    gateway: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = await _model(gateway)
    huge = _line("keeper", 1, model, text=TEXT * 4)  # 145 KB
    status, reply = await _import(gateway, [_line("keeper", 0, model), huge])
    assert status == 413, reply
    assert reply["error"] == (
        f"line 2 is {len(huge):,} bytes; at most {LINE_BYTES:,} go to the store in one call"
    )
    # The line before it was read, so it is written.
    assert (reply["lines"], reply["imported"]) == (2, 1)

    # A row written while lines could be larger is refused by name when exported.
    status, reply = await _import(gateway, [_line("keeper", 0, model)])
    assert status == 200 and reply["skipped"] == 1, reply
    monkeypatch.setattr(store_transfer, "MAX_TRANSFER_LINE_BYTES", 20 * 1024)
    async with gateway.get("/api/v1/export", params={"user_id": "keeper"}) as answer:
        assert answer.status == 413
        assert "memory 'keeper-0' is " in (await answer.json())["error"]


@pytest.mark.parametrize("gateway_app", [{"body_timeout_s": 1.0}], indirect=True)
async def test_an_import_whose_client_stops_sending_is_a_408_with_what_it_wrote(
    gateway: TestClient[Any, Any],
) -> None:
    model = await _model(gateway)
    # One line a batch (two pass the budget): the first is written while the next are read.
    body = "".join(_line("stalled", n, model) + "\n" for n in range(3)).encode()
    reader, writer = await asyncio.open_connection(gateway.host, gateway.port)
    try:
        writer.write(
            b"POST /api/v1/import HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n"
        )  # and never the last chunk
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = int(head.lower().split("content-length:")[1].split("\r\n")[0])
        reply = json.loads(await reader.readexactly(length))
    finally:
        writer.close()
    assert head.startswith("HTTP/1.1 408"), head
    # Every line that arrived before the client went quiet is written.
    assert reply == {"lines": 3, "imported": 3, "skipped": 0, "refused": 0, "errors": [],
                     "stopped": True, "error": "request body not received within 1s"}
    async with gateway.get("/api/v1/export", params={"user_id": "stalled"}) as answer:
        exported = [json.loads(line) for line in (await answer.text()).splitlines()[1:-1]]
    assert [line["memory"]["id"] for line in exported] == [f"stalled-{n}" for n in range(3)]


@pytest.mark.parametrize("gateway_app", [{"body_timeout_s": 2.0}], indirect=True)
@pytest.mark.parametrize("whole", [0, 3], ids=["no chunk before it", "a chunk before it"])
@pytest.mark.parametrize("behind", [False, True], ids=["first", "behind another request"])
async def test_an_import_whose_framing_breaks_before_its_route_starts_is_refused_at_once(
    gateway_app: web.Application, whole: int, behind: bool
) -> None:
    # The head (and the chunks before the break) in one read, the broken chunk size in the next,
    # before the route started (as when both arrive at once, or behind a request still being
    # served): until 2026-12-07, with no chunk before it, the break was not seen and the import
    # waited out the body timeout (408); then, behind another request, the connection closed
    # after that one's answer, the import never answered.
    lines = "".join(
        json.dumps({"type": "memory", "memory": {"user_id": "early", "content": f"Note {n}."}})
        + "\n" for n in range(whole)
    ).encode()
    chunk = b"%x\r\n" % len(lines) + lines + b"\r\n" if lines else b""
    runner = AppRunner(gateway_app)
    await runner.setup()
    ours, theirs = socket.socketpair()
    try:
        assert runner.server is not None
        _, protocol = await asyncio.get_running_loop().connect_accepted_socket(
            runner.server, ours
        )
        reader, writer = await asyncio.open_connection(sock=theirs)
        if behind:
            protocol.data_received(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        protocol.data_received(
            b"POST /api/v1/import HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunk
        )
        protocol.data_received(b"zz\r\n")
        answer = await asyncio.wait_for(reader.read(), WAIT_CEILING_S)
        writer.close()
    finally:
        await runner.cleanup()
    if behind:
        assert answer.startswith(b"HTTP/1.1 200"), answer
        answer = answer[answer.index(b"HTTP/1.1 ", 1):]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    # The whole lines before the break are written, as with a break the route meets.
    assert json.loads(body) == {
        "lines": whole, "imported": whole, "skipped": 0, "refused": 0, "errors": [],
        "stopped": True, "error": "bad body: Invalid character in chunk size",
    }


async def test_an_export_cut_short_after_its_first_page_ends_with_a_line_saying_why(
    gateway: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = await _model(gateway)
    status, reply = await _import(
        gateway, [_line("cut", 0, model, text="short"), _line("cut", 1, model)]
    )
    assert status == 200, reply
    # A row written while lines could be larger, on the second page: the 200 went out.
    monkeypatch.setattr(store_transfer, "MAX_TRANSFER_LINE_BYTES", 20 * 1024)
    monkeypatch.setattr(gateway_transfer, "PAGE_LINES", 1)
    received: list[bytes] = []
    async with gateway.get("/api/v1/export", params={"user_id": "cut"}) as answer:
        assert answer.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):  # and the stream is left unended
            while line := await answer.content.readline():
                received.append(line)
    head, first, last = (json.loads(line) for line in received)  # and no end line
    assert first["memory"]["id"] == "cut-0"
    reason = last["error"]
    assert "memory 'cut-1' is " in reason and "can be exported" in reason

    # The command line names the reason; an import of what arrived refuses that line.
    cli = Gateway(url=str(gateway.make_url("")).rstrip("/"))
    with pytest.raises(GatewayError, match=re.escape(f"cut short by the server: {reason}")):
        await cli.export_to(io.BytesIO(), {"user_id": "cut"})
    status, reply = await _import(gateway, [line.decode().rstrip("\n") for line in received])
    assert status == 400, reply
    assert reply["errors"] == [{"line": 3, "error": f"the export was cut short here: {reason}"}]
    assert reply["complete"] is False
