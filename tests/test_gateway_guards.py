"""The gateway alone over real HTTP: guards, token, JSON errors and parameter checks.

Every request here is refused before the gateway calls another service, so no store runs.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from multidict import CIMultiDict

from gateway.app import make_app
from gateway.config import GatewayConfig
from gateway.errors import client_message
from gateway.routes import transfer as transfer_routes
from gateway.routes.memories import UNSCOPED_DELETE
from gateway.routes.transfer import EVERY_OWNER
from gateway.state import CONFIG, STORE
from shared.errors import Internal, Overloaded, Unavailable
from shared.pb import store_pb2
from shared.settings import Settings

MakeClient = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
async def make_client(tmp_path: Path) -> AsyncIterator[MakeClient]:
    """Starts gateways (no store or search behind them) and closes them afterwards."""
    clients: list[TestClient[Any, Any]] = []

    async def make(**overrides: Any) -> TestClient[Any, Any]:
        config = GatewayConfig(
            store_address=f"unix:{tmp_path / 'store.sock'}",
            search_address=f"unix:{tmp_path / 'search.sock'}",
            mode=overrides.pop("mode", "lite"),
            rpc_timeout_s=5.0,
            **overrides,
        )
        settings = Settings(data_dir=tmp_path, run_dir=tmp_path / "run")
        client = TestClient(TestServer(make_app(config, settings), host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def client(make_client: MakeClient) -> TestClient[Any, Any]:
    return await make_client()


async def _status_and_json(
    client: TestClient[Any, Any], method: str, path: str, **kw: Any
) -> tuple[int, Any]:
    async with client.request(method, path, **kw) as reply:
        assert "Access-Control-Allow-Origin" not in reply.headers
        assert reply.content_type == "application/json"
        return reply.status, await reply.json()


# --- Host / Origin / Sec-Fetch-Site -------------------------------------------------------


@pytest.mark.parametrize("host", ["evil.example", "evil.example:19528", "attacker.localhost.com"])
async def test_dns_name_host_is_refused_even_on_healthz(
    client: TestClient[Any, Any], host: str
) -> None:
    status, body = await _status_and_json(client, "GET", "/healthz", headers={"Host": host})
    assert (status, body) == (403, {"error": "non-local Host refused"})


@pytest.mark.parametrize(
    "host",
    ["localhost", "LOCALHOST.:19528", "127.0.0.1:19528", "192.168.1.9", "[::1]:19528", "0.0.0.0"],
)
async def test_localhost_and_ip_literal_hosts_pass(client: TestClient[Any, Any], host: str) -> None:
    status, body = await _status_and_json(client, "GET", "/healthz", headers={"Host": host})
    assert (status, body) == (200, {"status": "ok"})


async def test_allowlisted_host_passes(make_client: MakeClient) -> None:
    client = await make_client(allowed_hosts=frozenset({"mybox.lan"}))
    status, _ = await _status_and_json(
        client, "GET", "/healthz", headers={"Host": "MyBox.lan.:19528"}
    )
    assert status == 200
    status, _ = await _status_and_json(client, "GET", "/healthz", headers={"Host": "other.lan"})
    assert status == 403


@pytest.mark.parametrize(
    "origin",
    [
        "http://evil.example",
        "https://evil.example:19528",
        "null",
        "file:///tmp/x.html",
        "chrome-extension://abc",
        "http://192.168.1.50:19528",
    ],
)
async def test_foreign_null_and_non_http_origins_are_refused(
    client: TestClient[Any, Any], origin: str
) -> None:
    status, body = await _status_and_json(client, "GET", "/healthz", headers={"Origin": origin})
    assert (status, body) == (403, {"error": "cross-origin request refused"})


@pytest.mark.parametrize(
    "origin",
    ["http://localhost:3000", "http://127.0.0.1:5173", "https://[::1]:8443", "http://127.9.9.9"],
)
async def test_loopback_origin_passes(client: TestClient[Any, Any], origin: str) -> None:
    status, _ = await _status_and_json(client, "GET", "/healthz", headers={"Origin": origin})
    assert status == 200


async def test_same_host_origin_passes_but_other_port_does_not(
    client: TestClient[Any, Any],
) -> None:
    same = {"Host": "192.168.1.9:19528", "Origin": "http://192.168.1.9:19528"}
    assert (await _status_and_json(client, "GET", "/healthz", headers=same))[0] == 200
    other = {"Host": "192.168.1.9:19528", "Origin": "http://192.168.1.9:8080"}
    assert (await _status_and_json(client, "GET", "/healthz", headers=other))[0] == 403


@pytest.mark.parametrize("headers", [
    [("Host", "[::1]evil.com")],
    [("Origin", "http://evil.com@127.0.0.1")],
    [("Host", "127.0.0.1:19528"), ("Host", "evil.com")],
    [("Origin", "http://127.0.0.1:19528"), ("Origin", "http://evil.com")],
    [("Sec-Fetch-Site", "same-origin"), ("Sec-Fetch-Site", "cross-site")],
])
async def test_a_guard_header_that_reads_two_ways_is_refused(
    client: TestClient[Any, Any], headers: list[tuple[str, str]]
) -> None:
    # No browser sends these; a proxy or a client in between might, and each guard reads one.
    status, reply = await _status_and_json(client, "GET", "/healthz", headers=CIMultiDict(headers))
    assert status == 403, reply


@pytest.mark.parametrize("kind", ["text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x", None,
                                  "application/csp-report", "text/ping",
                                  "application/reports+json"])
async def test_a_write_a_page_on_another_loopback_port_sends_without_asking_is_refused(
    client: TestClient[Any, Any], kind: str | None
) -> None:
    # What a page on http://127.0.0.1:8888 sends with fetch(..., {mode: "no-cors"}) or a form,
    # or what the browser posts for it (a CSP report to the report-uri it names, a link's
    # ping): the browser asks nothing first, so only the type tells it from a JSON client's
    # call.
    page = {"Origin": "http://127.0.0.1:8888", "Sec-Fetch-Site": "same-site"}
    headers = page if kind is None else {**page, "Content-Type": kind}
    body = None if kind is None else b'{"text": "planted", "user_id": "alice"}'
    for path in ("/api/v1/add", "/api/v1/forget", "/api/v1/import", "/api/v1/digest"):
        status, reply = await _status_and_json(
            client, "POST", path, data=body, headers=headers, skip_auto_headers=["Content-Type"])
        assert status == 403, (path, status, reply)
        assert "must be sent as JSON" in reply["error"]


async def test_the_guard_on_forms_leaves_json_own_origin_and_reads_alone(
    make_client: MakeClient,
) -> None:
    # Each passes the guard and stops at the store behind it, which is not running here (503).
    client = await make_client(startup_wait_s=0.0)
    own = {"Host": "127.0.0.1:19528", "Origin": "http://127.0.0.1:19528",
           "Content-Type": "text/plain"}
    json_from_page = {"Origin": "http://127.0.0.1:8888", "Content-Type": "application/json"}
    for headers in (own, json_from_page, {"Content-Type": "text/plain"}):
        status, _ = await _status_and_json(
            client, "POST", "/api/v1/add", data=b'{"text": "x"}', headers=headers)
        assert status == 503, headers
    status, _ = await _status_and_json(
        client, "GET", "/api/v1/list", headers={"Origin": "http://127.0.0.1:8888"})
    assert status == 503


async def test_allowlisted_origin_passes(make_client: MakeClient) -> None:
    client = await make_client(allowed_hosts=frozenset({"notes.lan"}))
    headers = {"Origin": "https://notes.lan:4443"}
    assert (await _status_and_json(client, "GET", "/healthz", headers=headers))[0] == 200


async def test_cross_site_fetch_is_refused(client: TestClient[Any, Any]) -> None:
    status, body = await _status_and_json(
        client, "POST", "/api/v1/add", json={"text": "x"}, headers={"Sec-Fetch-Site": "Cross-Site"}
    )
    assert (status, body) == (403, {"error": "cross-site request refused", "success": False})


async def test_a_link_from_another_site_opens_the_dashboard_but_not_its_data(
    client: TestClient[Any, Any],
) -> None:
    link = {
        "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"
    }
    for path in ("/dashboard/", "/dashboard"):
        async with client.get(path, headers=link) as reply:
            assert reply.status == 200 and reply.content_type == "text/html", path
    # Only the public shell, only opened in a tab: data, writes and fetches stay refused.
    for method, path, headers in (
        ("GET", "/dashboard/api/system", link),
        ("GET", "/api/v1/status", link),
        ("POST", "/dashboard/", link),
        ("GET", "/dashboard/app.js", {**link, "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty"}),
        ("GET", "/dashboard/", {**link, "Sec-Fetch-Dest": "iframe"}),
    ):
        async with client.request(method, path, headers=headers) as reply:
            assert reply.status == 403, (method, path, headers)
            assert (await reply.json())["error"] == "cross-site request refused"


async def test_same_origin_fetch_without_origin_header_passes(client: TestClient[Any, Any]) -> None:
    headers = {"Sec-Fetch-Site": "same-origin"}
    assert (await _status_and_json(client, "GET", "/healthz", headers=headers))[0] == 200


# --- bearer token ------------------------------------------------------------------------


async def test_token_is_required_on_every_route_but_healthz(make_client: MakeClient) -> None:
    client = await make_client(token="s3cret-token")
    assert (await _status_and_json(client, "GET", "/healthz"))[0] == 200
    for path in ("/api/v1/status", "/api/v1/graph", "/api/v1/list", "/no/such/route"):
        async with client.get(path) as reply:
            assert reply.status == 401, path
            assert reply.headers["WWW-Authenticate"] == "Bearer"
            assert "bearer token" in (await reply.json())["error"]
    status, body = await _status_and_json(
        client,
        "POST",
        "/api/v1/add",
        json={"text": "secret"},
        headers={"Authorization": "Bearer wrong"},
    )
    assert status == 401 and body["success"] is False
    wrong_scheme = {"Authorization": "Basic s3cret-token"}
    assert (await _status_and_json(client, "GET", "/api/v1/graph", headers=wrong_scheme))[0] == 401


async def test_right_token_is_accepted(make_client: MakeClient) -> None:
    client = await make_client(token="s3cret-token")
    auth = {"Authorization": "Bearer s3cret-token"}
    # Past the token check, the export route itself refuses every owner without the admin switch.
    status, body = await _status_and_json(client, "GET", "/api/v1/export", headers=auth)
    assert (status, body) == (403, {"error": EVERY_OWNER})
    status, body = await _status_and_json(client, "POST", "/api/v1/add", json={}, headers=auth)
    assert (status, body) == (400, {"error": "text required", "success": False})


async def test_guards_run_before_the_token_check(make_client: MakeClient) -> None:
    client = await make_client(token="s3cret-token")
    status, body = await _status_and_json(
        client, "GET", "/healthz", headers={"Host": "evil.example"}
    )
    assert (status, body) == (403, {"error": "non-local Host refused"})


# --- bad input ---------------------------------------------------------------------------


async def test_add_without_text_is_400(client: TestClient[Any, Any]) -> None:
    for body in ({}, {"text": ""}, {"text": "   "}, {"data": ""}, {"user_id": "u"}):
        status, reply = await _status_and_json(client, "POST", "/api/v1/add", json=body)
        assert (status, reply) == (400, {"error": "text required", "success": False}), body
    status, reply = await _status_and_json(client, "POST", "/api/v1/add")
    assert (status, reply) == (400, {"error": "text required", "success": False})


async def test_malformed_json_is_bad_body(client: TestClient[Any, Any]) -> None:
    for path in ("/api/v1/add", "/api/v1/search", "/api/v1/list"):
        status, reply = await _status_and_json(client, "POST", path, data=b'{"text": "x"')
        assert status == 400 and reply["error"] == "bad body", path
    status, reply = await _status_and_json(client, "POST", "/api/v1/add", data=b'{"text": NaN}')
    assert status == 400 and reply["error"] == "bad body"


async def test_json_that_is_not_an_object_is_400(client: TestClient[Any, Any]) -> None:
    for raw in (b'["text"]', b'"text"', b"42", b"null"):
        status, reply = await _status_and_json(client, "POST", "/api/v1/add", data=raw)
        assert status == 400 and "expected a JSON object" in reply["error"], raw


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/v1/add", {"text": 5}, "text"),
        ("/api/v1/add", {"text": "x", "user_id": 7}, "user_id"),
        ("/api/v1/add", {"text": "x", "agent_id": ["a"]}, "agent_id"),
        ("/api/v1/add", {"text": "x", "metadata": "k=v"}, "metadata"),
        ("/api/v1/add", {"text": "x", "metadata": ["k"]}, "metadata"),
        ("/api/v1/add", {"text": "x", "session_id": {}}, "session_id"),
        ("/api/v1/add", {"text": "x", "event_at": "last tuesday"}, "event_at"),
        ("/api/v1/add", {"text": "x", "event_at": True}, "event_at"),
        ("/api/v1/search", {"query": 3}, "query"),
        ("/api/v1/search", {"query": "q", "limit": "ten"}, "limit"),
        ("/api/v1/search", {"query": "q", "limit": 2.5}, "limit"),
        ("/api/v1/search", {"query": "q", "min_score": "high"}, "min_score"),
        ("/api/v1/search", {"query": "q", "min_score": 1.5}, "min_score"),
        ("/api/v1/search", {"query": "q", "user_ids": "a,b,c", "agent_ids": [1]}, "agent_ids"),
        ("/api/v1/search", {"query": "q", "layer": "l9_dreams"}, "layer"),
        # An offset in seconds, which ISO 8601 allows and RFC3339 does not.
        (
            "/api/v1/search",
            {"query": "q", "reference_time": "2024-05-15T20:00+01:00:30"},
            "reference_time",
        ),
        ("/api/v1/add", {"text": "x", "event_at": "2024-05-15T20:00-08:00:30"}, "event_at"),
        ("/api/v1/update", {"id": "m", "event_at": "2024-05-15T20:00+05:30:01"}, "event_at"),
        ("/api/v1/list", {"limit": True}, "limit"),
        ("/api/v1/list", {"offset": -1}, "offset"),
        ("/api/v1/list", {"include_raw": "maybe"}, "include_raw"),
        ("/api/v1/list", {"layer": "l0"}, "layer"),
        ("/api/v1/delete_all", {"id": 12}, "id"),
        ("/api/v1/delete_all", {"layer": "nope"}, "layer"),
    ],
)
async def test_wrong_types_are_400_naming_the_field(
    client: TestClient[Any, Any], path: str, body: dict[str, Any], field: str
) -> None:
    status, reply = await _status_and_json(client, "POST", path, json=body)
    assert status == 400
    assert field in reply["error"]


async def test_query_string_parameters_are_type_checked(client: TestClient[Any, Any]) -> None:
    status, reply = await _status_and_json(client, "GET", "/api/v1/list?limit=abc")
    assert (status, reply) == (400, {"error": "limit must be an integer"})
    status, reply = await _status_and_json(client, "GET", "/api/v1/list?layer=l42")
    assert status == 400 and "unknown layer 'l42'" in reply["error"]
    status, reply = await _status_and_json(client, "GET", "/api/v1/search?query=x&min_score=lots")
    assert (status, reply) == (400, {"error": "min_score must be a number"})


async def test_search_without_query_is_400(client: TestClient[Any, Any]) -> None:
    status, reply = await _status_and_json(client, "POST", "/api/v1/search", json={"limit": 3})
    assert (status, reply) == (400, {"error": "query required"})


async def test_body_over_8_mib_is_413_json(client: TestClient[Any, Any]) -> None:
    payload = io.BytesIO(b'{"text": "' + b"a" * (9 * 1024 * 1024) + b'"}')
    status, reply = await _status_and_json(client, "POST", "/api/v1/add", data=payload)
    assert status == 413
    assert reply == {"error": "request body is over the 8 MiB limit", "success": False}


async def test_unknown_route_and_wrong_method_are_json(client: TestClient[Any, Any]) -> None:
    assert await _status_and_json(client, "GET", "/api/v1/nope") == (404, {"error": "not found"})
    async with client.get("/api/v1/add") as reply:
        assert reply.status == 405
        assert reply.headers["Allow"] == "POST"
        assert await reply.json() == {"error": "method not allowed"}


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/healthz", {"GET", "HEAD"}),
        ("/readyz", {"GET", "HEAD"}),
        ("/api/v1/status", {"GET", "HEAD"}),
        ("/api/v1/metrics", {"GET", "HEAD"}),
        ("/api/v1/graph", {"GET", "HEAD", "POST"}),
        ("/api/v1/digest", {"GET", "HEAD", "POST"}),
        ("/api/v1/admin/snapshot", {"POST"}),
    ],
)
async def test_a_method_a_route_does_not_document_is_405_json(
    make_client: MakeClient, path: str, allowed: set[str]
) -> None:
    client = await make_client(mode="ultra")  # where digest runs a pass on POST
    for method in ("GET", "PUT", "DELETE", "PATCH", "TRACE"):
        if method in allowed:
            continue
        async with client.request(method, path) as reply:
            assert reply.status == 405, (method, path)
            assert set(reply.headers["Allow"].split(",")) == allowed
            assert await reply.json() == {"error": "method not allowed"}


# --- delete_all without a store ----------------------------------------------------------


async def test_delete_all_other_methods_are_405_with_allow(client: TestClient[Any, Any]) -> None:
    for method in ("GET", "PUT", "PATCH"):
        async with client.request(method, "/api/v1/delete_all?layer=l2_raw") as reply:
            assert reply.status == 405
            assert reply.headers["Allow"] == "POST, DELETE"
            assert await reply.json() == {
                "deleted_count": 0,
                "error": "method not allowed: use POST or DELETE",
            }


async def test_unscoped_delete_is_refused(client: TestClient[Any, Any]) -> None:
    for method, kw in (
        ("POST", {}),
        ("DELETE", {"json": {"layer": "*"}}),
        ("POST", {"json": {"all": False}}),
    ):
        status, reply = await _status_and_json(client, method, "/api/v1/delete_all", **kw)
        assert (status, reply) == (400, {"deleted_count": 0, "error": UNSCOPED_DELETE})


async def test_bulk_delete_needs_admin(client: TestClient[Any, Any]) -> None:
    for kw in (
        {"json": {"layer": "l2_raw"}},
        {"json": {"user_id": "alice"}},
        {"json": {"all": True}},
        {"params": {"confirm": "wipe-all"}},
        {"params": {"agent_id": "bot"}},
    ):
        status, reply = await _status_and_json(client, "POST", "/api/v1/delete_all", **kw)
        assert status == 403, kw
        assert reply["deleted_count"] == 0 and "HYATLAS_ADMIN=on" in reply["error"]


async def test_a_file_the_dashboard_lacks_is_a_json_404(client: TestClient[Any, Any]) -> None:
    status, reply = await _status_and_json(client, "GET", "/dashboard/assets/app.js")
    assert status == 404 and "/dashboard/assets/app.js" in reply["error"]


async def test_digest_in_lite_and_pro_says_there_is_no_slow_path(make_client: MakeClient) -> None:
    for mode in ("lite", "pro"):
        client = await make_client(mode=mode)
        status, reply = await _status_and_json(client, "POST", "/api/v1/digest")
        assert status == 200
        assert reply == {
            "digest_ok": False,
            "mode": mode,
            "reason": "this mode has no slow path; consolidation runs only in ultra",
        }


async def test_digest_in_ultra_needs_the_consolidator_and_reprocess_the_extractor(
    make_client: MakeClient,
) -> None:
    client = await make_client(mode="ultra")
    status, reply = await _status_and_json(client, "POST", "/api/v1/digest")
    assert status == 503 and reply["digest_ok"] is False and "unavailable" in reply["error"]
    status, reply = await _status_and_json(client, "POST", "/api/v1/reprocess")
    assert status == 503 and "unavailable" in reply["error"]


async def test_reprocess_in_lite_notes_extraction_is_off(client: TestClient[Any, Any]) -> None:
    status, reply = await _status_and_json(
        client, "POST", "/api/v1/reprocess", json={"ids": ["m1", "m2"]}
    )
    assert status == 200
    assert reply == {
        "reprocessed": 0,
        "failed": 0,
        "skipped": 2,
        "note": "mode is lite; extraction is disabled, nothing to reprocess",
    }


async def test_store_down_is_503_json(client: TestClient[Any, Any]) -> None:
    status, reply = await _status_and_json(client, "GET", "/api/v1/status")
    assert status == 503 and reply["error"] == "a backing service is unavailable: store"
    status, reply = await _status_and_json(client, "POST", "/api/v1/add", json={"text": "x"})
    assert status == 503 and reply["success"] is False


def test_a_busy_backing_service_is_told_as_busy_not_as_down() -> None:
    # A write refused for the embedder's full queue told the client its store was unavailable.
    request = make_mocked_request("POST", "/api/v1/add")
    full = "embedder: embedder queue is full (300 vectors waiting, limit 256)"
    assert client_message(request, Overloaded(full, service="store")) == (
        "server busy: store has too much work queued; retry shortly"
    )
    down = Unavailable("failed to connect to all addresses", service="store")
    assert client_message(request, down) == "a backing service is unavailable: store"


async def test_an_import_batch_whose_embedding_ahead_is_refused_is_embedded_as_written(
    tmp_path: Path,
) -> None:
    asked: list[int] = []

    class RefusingStore:
        """A store client whose ahead-embedding is refused, as the real one raises it."""

        async def EmbedImport(self, request: Any, **call: Any) -> Any:
            asked.append(len(request.lines))
            raise Overloaded("embedder queue is full")

    app = web.Application()
    app[STORE] = RefusingStore()  # type: ignore[misc]
    app[CONFIG] = GatewayConfig(
        store_address=f"unix:{tmp_path / 'store.sock'}",
        search_address=f"unix:{tmp_path / 'search.sock'}",
        mode="lite",
    )
    request = make_mocked_request("POST", "/api/v1/import", app=app)
    batch = [store_pb2.ImportLine(line=1, json='{"type": "memory"}')]
    assert await transfer_routes._embedded(request, transfer_routes._Import(), batch) is None
    assert asked == [1]


async def test_an_import_whose_later_batch_fails_says_what_the_batches_before_wrote(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[int] = []

    async def no_vectors(*args: Any) -> None:
        return None

    async def send(request: web.Request, run: Any, batch: list[Any], embedding: Any) -> None:
        await embedding
        sent.append(len(batch))
        if len(sent) == 2:
            raise Internal("UnicodeEncodeError: secret-row-text")
        run.imported += len(batch)

    monkeypatch.setattr(transfer_routes, "_embedded", no_vectors)
    monkeypatch.setattr(transfer_routes, "_send", send)
    line = b'{"type": "memory", "memory": {"user_id": "u", "content": "x"}}\n'
    status, body = await _status_and_json(
        client, "POST", "/api/v1/import", data=io.BytesIO(line * 600)
    )
    # The first batch was written; the reply says so, so a retry can skip it.
    assert status == 500 and sent == [500, 100]
    assert (body["lines"], body["imported"]) == (600, 500)
    assert body["error"].startswith("internal error (id ") and "secret" not in body["error"]
