"""A store on PostgreSQL in trouble. While its database is away, refused calls are 503s (not
500s), health says not ready, and it waits at start for a database that is not up yet; a database
that cannot serve it stops the start with one clear line; vectors of another model than the
embedder runs (no re-embed on this backend) show in status, doctor and reembed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import postgres_server
from tests.support import (
    ROOT,
    ServiceProcess,
    Stack,
    assert_eventually,
    base_env,
    grpc_serving,
    running_stack,
)
from tests.test_cli import hyatlas

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def databases() -> Iterator[Any]:
    """A server of this module's own: the tests stop and start it."""
    with postgres_server() as server:
        yield server


async def _call(stack: Stack, method: str, path: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.request(
        method, stack.base_url + path, **kw
    ) as reply:
        return reply.status, await reply.json()


async def test_a_database_gone_while_serving_is_503_and_not_ready_until_it_is_back(
    tmp_path: Path, embedder_address: str, databases: Any
) -> None:
    with running_stack(
        tmp_path, ["store", "search", "gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_STORE_DSN=databases.new_dsn(),
    ) as stack:
        add = {"json": {"text": "Ada keeps bees", "user_id": "ada"}}
        assert (await _call(stack, "POST", "/api/v1/add", **add))[0] == 200
        databases.halt()
        try:
            status, body = await _call(stack, "POST", "/api/v1/add", **add)
            assert status == 503, body
            assert body["error"] == "a backing service is unavailable: store"
            status, body = await _call(stack, "POST", "/api/v1/search",
                                       json={"query": "bees", "user_id": "ada"})
            assert status == 503, body

            async def not_ready() -> None:
                status, body = await _call(stack, "GET", "/readyz")
                assert (status, body["services"]["store"]) == (503, "not_serving"), body

            await assert_eventually(not_ready)
        finally:
            databases.resume()

        async def ready() -> None:
            assert (await _call(stack, "GET", "/readyz"))[0] == 200

        await assert_eventually(ready)
        assert (await _call(stack, "POST", "/api/v1/add", **add))[0] == 200
        status, body = await _call(stack, "POST", "/api/v1/list", json={"user_id": "ada"})
        assert [m["content"] for m in body["memories"]] == ["Ada keeps bees"] * 2
    assert "Traceback" not in (tmp_path / "store.log").read_text()


async def test_status_hides_a_password_given_in_the_dsn_s_query(
    tmp_path: Path, embedder_address: str, databases: Any
) -> None:
    base = databases.new_dsn()
    dsn = base + ("&" if "?" in base else "?") + "password=S3cretPassw0rd&application_name=hy"
    with running_stack(
        tmp_path, ["store", "search", "gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_STORE_DSN=dsn,
    ) as stack:
        status, body = await _call(stack, "GET", "/api/v1/status")
    assert status == 200, body
    assert body["data_dir"].endswith("password=***&application_name=hy"), body["data_dir"]
    assert "S3cretPassw0rd" not in (tmp_path / "store.log").read_text()


async def test_a_store_started_before_its_database_waits_for_it(
    tmp_path: Path, embedder_address: str, databases: Any
) -> None:
    env = base_env(tmp_path, HYATLAS_EMBEDDER_ADDR=embedder_address,
                   HYATLAS_STORE_DSN=databases.new_dsn())
    log = tmp_path / "store.log"
    databases.halt()
    try:
        # Ready here means: running, and saying what it waits for.
        store = ServiceProcess(
            "services.store", env, lambda: "does not answer" in log.read_text(), log
        ).start()
    finally:
        databases.resume()
    try:
        address = Stack(tmp_path, env).address("store")
        await assert_eventually(lambda: grpc_serving(address))
    finally:
        assert store.stop() == 0


def test_a_database_that_cannot_serve_the_store_stops_its_start_with_one_clear_line(
    tmp_path: Path, embedder_address: str, databases: Any
) -> None:
    dsn = databases.new_dsn().replace("hyatlas_", "nosuch_", 1)
    env = base_env(tmp_path, HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_STORE_DSN=dsn)
    done = subprocess.run(
        [sys.executable, "-m", "services.store"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120, check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "cannot start: database" in done.stderr and "does not exist" in done.stderr


async def test_vectors_of_another_model_fail_status_doctor_and_reembed_saying_why(
    tmp_path: Path, embedder_address: str, databases: Any
) -> None:
    dsn = databases.new_dsn()
    services = ["store", "search", "gateway"]
    with running_stack(tmp_path, ["store"], HYATLAS_EMBEDDER_ADDR=embedder_address,
                       HYATLAS_STORE_DSN=dsn):
        pass
    databases.sql("UPDATE store_meta SET value = 'an-older-model' WHERE key = 'model_id'",
                  database=databases.database_name(dsn))
    with running_stack(tmp_path, services, HYATLAS_EMBEDDER_ADDR=embedder_address,
                       HYATLAS_STORE_DSN=dsn) as stack:
        status, body = await _call(stack, "GET", "/api/v1/status")
        assert (status, body["status"]) == (200, "degraded"), body
        assert "a re-embed is not built for the PostgreSQL store" in body["embed_problem"]
        done = hyatlas(stack, "reembed", token="")
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("no re-embed runs: the database's vectors come from model")
        done = hyatlas(stack, "doctor", token="")
        assert done.returncode == 1, done.stdout
        assert "FAIL model: the database's vectors come from model 'an-older-model'" in (
            done.stdout
        )
        status, body = await _call(stack, "POST", "/api/v1/add",
                                   json={"text": "Ada keeps bees", "user_id": "ada"})
        assert status == 409, body
