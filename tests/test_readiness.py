"""Readiness: /readyz and status say whether every backing service answers; start-up writes wait;
`make run`'s launcher prints one line when ready and keeps its files under the data it was given."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.extractor_support import Api, new_user
from tests.support import (
    ROOT,
    WAIT_CEILING_S,
    ServiceProcess,
    Stack,
    assert_eventually,
    base_env,
    free_port,
    grpc_serving,
    running_stack,
    value_eventually,
)

pytestmark = pytest.mark.slow


async def test_readyz_is_503_until_every_backing_service_answers(
    tmp_path: Path, embedder_address: str
) -> None:
    with running_stack(tmp_path, ["gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address) as stack:
        api = Api(stack.base_url, stack.address("store"))
        assert await api.call("GET", "/healthz") == (200, {"status": "ok"})
        status, body = await api.call("GET", "/readyz")
        assert status == 503 and body["ready"] is False, body
        assert body["services"]["embedder"] == "serving"
        assert body["services"]["store"] == "unreachable"

        for service in ("store", "search"):
            await asyncio.to_thread(stack.start, service)

        async def ready() -> dict:
            status, body = await api.call("GET", "/readyz")
            assert status == 200, body
            return body

        body = await value_eventually(ready)
        assert body["status"] == "ready"
        # Lite mode needs neither the extractor nor the consolidator (this stack runs neither).
        assert body["services"] == {"embedder": "serving", "store": "serving",
                                    "search": "serving"}
        status_body = await api.status()
        assert status_body["ready"] is True
        assert status_body["services"] == body["services"]


async def test_an_ultra_node_without_a_consolidator_serves_ready_but_says_it_is_degraded(
    tmp_path: Path, embedder_address: str
) -> None:
    # A node of a cluster whose consolidator runs on the other node, that node down: writes
    # and searches go on here, so a balancer checking /readyz must keep it; status and doctor
    # still say the slow path waits.
    with running_stack(
        tmp_path, ["store", "search", "extractor", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_MODE="ultra",
    ) as stack:
        api = Api(stack.base_url, stack.address("store"))

        async def ready() -> dict:
            status, body = await api.call("GET", "/readyz")
            assert status == 200, body
            return body

        body = await value_eventually(ready)
        assert body["services"]["consolidator"] == "unreachable"
        status = await api.status()
        assert (status["ready"], status["status"], status["write_pipeline"]) == (
            True, "degraded", "ok")
        env = {**stack.env, "HYATLAS_SERVER_URL": stack.base_url}
        doctor = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "hyatlas_cli", "doctor"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert doctor.returncode == 1 and doctor.stdout.startswith("FAIL services ready"), (
            doctor.stdout)

        await asyncio.to_thread(stack.start, "consolidator")

        async def whole() -> dict:
            status = await api.status()
            assert status["status"] == "ok", status
            return status

        await value_eventually(whole)


async def test_status_names_the_embedder_away_as_what_stops_writes(tmp_path: Path) -> None:
    with running_stack(tmp_path, ["embedder", "store", "search", "gateway"]) as stack:
        api = Api(stack.base_url, stack.address("store"))
        assert (await api.status())["write_pipeline"] == "ok"
        await asyncio.to_thread(stack.procs["embedder"].stop)

        async def degraded() -> dict:
            status = await api.status()
            assert status["write_pipeline"] == "degraded: the embedder is unreachable", status
            return status

        status = await value_eventually(degraded)
        assert (status["status"], status["ready"]) == ("degraded", False)
        code, body = await api.call("POST", "/api/v1/add", json={"text": "x", "user_id": "u"})
        assert (code, body["error"]) == (
            503, "a backing service is unavailable: embedder (called through the store)")


async def test_status_with_the_store_away_still_says_what_serves(tmp_path: Path) -> None:
    # It was a bare {"error": ...}: no services, no write_pipeline, though the README says both.
    with running_stack(tmp_path, ["embedder", "store", "search", "gateway"]) as stack:
        api = Api(stack.base_url, stack.address("store"))
        await asyncio.to_thread(stack.procs["store"].stop)

        async def away() -> dict:
            code, body = await api.call("GET", "/api/v1/status")
            assert code == 503 and body["services"]["store"] != "serving", body
            return body

        body = await value_eventually(away)
        assert body["error"] == "a backing service is unavailable: store"
        assert (body["status"], body["ready"], body["mode"]) == ("degraded", False, "lite")
        assert body["write_pipeline"] == f"degraded: the store is {body['services']['store']}"
        assert body["services"]["embedder"] == "serving"
        assert (body["scopes"], body["reaches_every_owner"]) == (["read", "write", "admin"], True)


async def test_a_write_sent_before_the_store_is_up_waits_for_it(
    tmp_path: Path, embedder_address: str
) -> None:
    with running_stack(
        tmp_path, ["gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_STARTUP_WAIT=f"{WAIT_CEILING_S:g}s",
    ) as stack:
        user = new_user()
        body = json.dumps({"text": "Written while the store was starting", "user_id": user})
        port = int(stack.env["HYATLAS_GO_PORT"])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /api/v1/add HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}".encode()
        )
        await writer.drain()
        # The request is in the gateway before the store process even exists.
        await asyncio.to_thread(stack.start, "store")
        reply = await reader.read()
        writer.close()
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), reply
        assert json.loads(payload)["success"] is True
        rows = await Api(stack.base_url, stack.address("store")).rows(user, "l2_raw")
        assert [r.content for r in rows] == ["Written while the store was starting"]


async def test_a_write_with_no_store_answers_503_that_says_so(
    tmp_path: Path, embedder_address: str
) -> None:
    with running_stack(tmp_path, ["gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address,
                       HYATLAS_STARTUP_WAIT="off") as stack:
        status, body = await Api(stack.base_url, "").call(
            "POST", "/api/v1/add", json={"text": "nowhere to go", "user_id": new_user()})
    assert status == 503
    assert "store did not answer" in body["error"], body


def _waiting_lines(log: Path, address: str, service: str = "embedder") -> list[dict]:
    """A service's log lines saying it still waits for the service at address."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    said = f"the {service} at {address} does not answer"
    return [line for line in lines if line["msg"].startswith(said)]


async def test_a_store_started_before_its_embedder_waits_for_it_with_a_warning_line_each_time(
    tmp_path: Path,
) -> None:
    address = f"unix:{tmp_path / 'embedder.sock'}"
    env = base_env(tmp_path / "data", HYATLAS_EMBEDDER_ADDR=address)
    log = tmp_path / "store.log"
    # Ready here means: running, and saying twice what it waits for. It exited after a minute
    # with a traceback (TimeoutError), to be restarted into the same wait.
    store = ServiceProcess(
        "services.store", env, lambda: len(_waiting_lines(log, address)) >= 2, log
    ).start()
    try:
        for line in _waiting_lines(log, address):
            assert line["level"] == "warning" and "exc" not in line, line
            assert line["msg"].endswith("; still waiting for it"), line
        embedder_env = base_env(tmp_path / "embedder", HYATLAS_EMBEDDER_ADDR=address)
        embedder = ServiceProcess(
            "services.embedder", embedder_env, lambda: grpc_serving(address),
            tmp_path / "embedder.log",
        ).start()
        try:
            store_address = Stack(tmp_path / "data", env).address("store")
            await assert_eventually(lambda: grpc_serving(store_address))
        finally:
            assert store.stop() == 0
            embedder.stop()
    finally:
        store.kill()
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("service", ["extractor", "consolidator"])
async def test_a_slow_path_service_started_before_its_store_waits_for_it_with_a_warning_line(
    tmp_path: Path, embedder_address: str, service: str
) -> None:
    (tmp_path / "data").mkdir()
    env = base_env(tmp_path / "data", HYATLAS_EMBEDDER_ADDR=embedder_address,
                   HYATLAS_MODE="ultra")
    stack = Stack(tmp_path / "data", env)
    log = tmp_path / f"{service}.log"
    # It exited after a minute with a traceback (TimeoutError), to be restarted into the wait.
    waiting = ServiceProcess(
        f"services.{service}", env,
        lambda: bool(_waiting_lines(log, stack.address("store"), "store")), log,
    ).start()
    try:
        stack.start("store")
        await assert_eventually(lambda: grpc_serving(stack.address(service)))
        assert waiting.stop() == 0
    finally:
        waiting.kill()
        stack.stop_all()
    assert "Traceback" not in log.read_text()


def _launch(
    data_dir: Path, port: int, log_path: Path, **settings: str
) -> subprocess.Popen[bytes]:
    """`make run`'s launcher, lite mode, with its own data directory and port."""
    env = base_env(data_dir, HYATLAS_GO_PORT=str(port), **settings)
    del env["HYATLAS_RUN_DIR"]  # the default: <data>/run
    with log_path.open("wb") as log:
        return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "run.py")], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT)


def _program_states(supervisor_dir: Path) -> dict[str, str]:
    """Each program's state as supervisorctl reports it."""
    env = {"HYATLAS_SUPERVISOR_DIR": str(supervisor_dir)}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "supervisorctl"), "-c",
         str(ROOT / "deploy" / "supervisord.conf"), "status"],
        env=env, capture_output=True, text=True, check=False,
    )
    return dict(line.split()[:2] for line in done.stdout.splitlines() if line.strip())


async def test_two_launches_from_one_checkout_come_up_apart_and_write_once_ready(
    tmp_path: Path,
) -> None:
    launches = []
    for name in ("a", "b"):
        port, log_path = free_port(), tmp_path / f"{name}.log"
        launches.append((tmp_path / name, port, log_path,
                         _launch(tmp_path / name, port, log_path)))
    try:
        for data_dir, port, log_path, proc in launches:

            def ready_line(log_path: Path = log_path, proc: subprocess.Popen = proc) -> str:
                assert proc.poll() is None, log_path.read_text()[-4000:]
                lines = [line for line in log_path.read_text().splitlines()
                         if line.startswith("hyatlas: ready")]
                assert len(lines) == 1
                return lines[0]

            line = await value_eventually(ready_line, interval_s=0.2)
            assert f"http://127.0.0.1:{port}" in line and str(data_dir) in line
            # Ready means a write made at once is stored.
            api = Api(f"http://127.0.0.1:{port}", "")
            added = await api.add(f"written to {data_dir.name}", new_user())
            assert added["success"] is True
            supervisor_dir = data_dir / "run" / "supervisor"
            assert (supervisor_dir / "supervisord.pid").exists()
            assert (supervisor_dir / "supervisor.sock").exists()
            # Lite mode starts no extractor and no consolidator (a started program may still be
            # STARTING: supervisord calls it RUNNING once it has lived startsecs).
            states = _program_states(supervisor_dir)
            started = {name for name, state in states.items() if state in ("STARTING", "RUNNING")}
            assert started == {"embedder", "store:store-0", "search", "gateway"}, states
            assert (states["extractor"], states["consolidator"]) == ("STOPPED", "STOPPED")
    finally:
        for _, _, _, proc in launches:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(WAIT_CEILING_S) for _, _, _, proc in launches]
    assert codes == [0, 0]


async def test_a_launch_whose_store_cannot_start_says_so_and_stops_every_service(
    tmp_path: Path,
) -> None:
    # A setting only the store reads: supervisord restarts the store until it gives it up, and
    # the launcher, which used to wait for readiness forever, says so and stops.
    log_path = tmp_path / "run.log"
    proc = _launch(tmp_path / "data", free_port(), log_path, HYATLAS_INDEX_CACHE_MB="abc")

    def exited() -> int:
        code = proc.poll()
        assert code is not None
        return code

    try:
        code = await value_eventually(exited, interval_s=0.2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # run.py stops supervisord and every service
            proc.wait(WAIT_CEILING_S)
    log = log_path.read_text()
    assert code == 2, log[-4000:]
    assert "HYATLAS_INDEX_CACHE_MB must be a positive whole number of MiB, not 'abc'" in log
    assert "hyatlas: store:store-0 could not start" in log
    assert "hyatlas: ready" not in log
    assert not (tmp_path / "data" / "run" / "supervisor" / "supervisord.pid").exists()
