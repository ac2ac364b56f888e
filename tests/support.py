"""Test helpers: service processes on real sockets, polling waits, free ports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, overload

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


# The longest a test waits for a condition. A ceiling, not a budget: waits end as soon as the
# condition holds, so it is generous for a machine loaded by other work.
WAIT_CEILING_S = 120.0


class StoreBackend:
    """Where the stores a test starts keep their data: SQLite in their data dir (no databases),
    or one new PostgreSQL database per data dir (conftest's store_backend sets databases)."""

    databases: Any = None
    _dsns: dict[Path, str] = {}

    @classmethod
    def dsn(cls, data_dir: Path) -> str:
        """HYATLAS_STORE_DSN for a store in data_dir: "" for SQLite; the same database each
        time for one data dir, so a store restarted on it finds its rows."""
        if cls.databases is None:
            return ""
        key = data_dir.resolve()
        if key not in cls._dsns:
            cls._dsns[key] = cls.databases.new_dsn()
        return cls._dsns[key]


async def assert_eventually(
    check: Callable[[], Awaitable[bool | None]] | Callable[[], bool | None],
    timeout_s: float = WAIT_CEILING_S,
    interval_s: float = 0.05,
) -> None:
    """Calls check until it passes, or raises its last failure at timeout.

    A check passes only by returning True or None (a check that asserts and returns nothing)
    without AssertionError. Any other value, such as False, 0, [] or a dict, is a failure: a
    check that forgot its comparison must not pass at once. A check whose value the test needs
    goes to value_eventually.
    """
    await _poll(check, lambda result: result is True or result is None, timeout_s, interval_s)


@overload
async def value_eventually(
    produce: Callable[[], Awaitable[T]], timeout_s: float = ..., interval_s: float = ...
) -> T: ...


@overload
async def value_eventually(
    produce: Callable[[], T], timeout_s: float = ..., interval_s: float = ...
) -> T: ...


async def value_eventually(
    produce: Callable[[], Any],
    timeout_s: float = WAIT_CEILING_S,
    interval_s: float = 0.05,
) -> Any:
    """Calls produce until it returns without AssertionError, and returns what it returned.

    produce's own asserts are the condition; its value is handed back, not judged.
    """
    return await _poll(produce, lambda _: True, timeout_s, interval_s)


async def _poll(
    check: Callable[[], Any],
    accept: Callable[[Any], bool],
    timeout_s: float,
    interval_s: float,
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if asyncio.iscoroutine(result):
                result = await result
            if accept(result):
                return result
            error: BaseException = AssertionError(f"check returned {result!r}, not True or None")
        except AssertionError as exc:
            error = exc
        if time.monotonic() > deadline:
            raise error
        await asyncio.sleep(interval_s)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def grpc_serving(address: str) -> bool:
    """Whether the gRPC server at address answers SERVING on health."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=0.5
            )
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def http_ok(url: str) -> bool:
    """Whether a GET of url answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=0.5) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@dataclass
class ServiceProcess:
    """One service run as `python -m <module>` in its own process."""

    module: str
    env: Mapping[str, str]
    ready: Callable[[], bool]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    wrapper: tuple[str, ...] = ()
    """A command the service is run under (e.g. one that mounts its data dir first)."""

    def start(self, timeout_s: float = WAIT_CEILING_S) -> ServiceProcess:
        """Starts the process and waits until it is ready."""
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [*self.wrapper, sys.executable, "-m", self.module],
            cwd=ROOT,
            env=dict(self.env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited {self.proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"{self.module} not ready in {timeout_s}s:\n{self.logs()}")
            time.sleep(0.05)
        return self

    def logs(self) -> str:
        """What the process printed so far."""
        return self.log_path.read_text(errors="replace")[-8000:]

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then wait; kills if it does not stop in time. Returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextlib.asynccontextmanager
async def serving_http(app: web.Application) -> AsyncIterator[str]:
    """Serves an aiohttp app on a free loopback port for the block; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def base_env(data_dir: Path, **overrides: str) -> dict[str, str]:
    """The environment of a test service: this interpreter's, a data dir, lite mode."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYATLAS_")}
    env.update(
        {
            "HYATLAS_GO_DATA": str(data_dir),
            "HYATLAS_RUN_DIR": str(data_dir / "run"),
            "HYATLAS_MODE": "lite",
            "HYATLAS_SNAPSHOT_EVERY": "off",
            # A loaded machine must not turn a test's requests into 503s: deadlines, the wait for
            # a gateway slot and the embedder's queue are generous here, and the tests of those
            # limits set their own.
            "HYATLAS_READ_DEADLINE": "2m",
            "HYATLAS_WRITE_DEADLINE": "2m",
            "HYATLAS_QUEUE_WAIT": "2m",
            "HYATLAS_EMBED_MAX_QUEUE": "1000000",
            "PYTHONUNBUFFERED": "1",
        }
    )
    dsn = StoreBackend.dsn(data_dir)
    if dsn:
        env["HYATLAS_STORE_DSN"] = dsn
    env.update(overrides)
    return env


@dataclass
class Stack:
    """A set of service processes sharing one data dir."""

    data_dir: Path
    env: dict[str, str]
    procs: dict[str, ServiceProcess] = field(default_factory=dict)

    def address(self, service: str) -> str:
        """The gRPC address a service listens on in this stack."""
        key = f"HYATLAS_{service.upper()}_ADDR"
        return self.env.get(key) or f"unix:{self.data_dir / 'run' / (service + '.sock')}"

    @property
    def base_url(self) -> str:
        """The gateway's base URL."""
        return f"http://127.0.0.1:{self.env['HYATLAS_GO_PORT']}"

    def start(
        self, service: str, timeout_s: float = WAIT_CEILING_S, wrapper: tuple[str, ...] = ()
    ) -> ServiceProcess:
        """Starts one service (embedder, store, search, extractor, consolidator or gateway)."""
        if service == "gateway":
            module = "gateway"
            url = f"{self.base_url}/healthz"

            def ready() -> bool:
                return http_ok(url)

        else:
            module = f"services.{service}"
            address = self.address(service)

            def ready() -> bool:
                return grpc_serving(address)

        log_path = self.data_dir / f"{service}.log"
        proc = ServiceProcess(module, self.env, ready, log_path, wrapper=wrapper)
        self.procs[service] = proc.start(timeout_s)
        return proc

    def stop_all(self) -> None:
        """Stops every process, last started first."""
        for proc in reversed(list(self.procs.values())):
            proc.stop()


@contextlib.contextmanager
def running_stack(
    data_dir: Path, services: list[str], **env_overrides: str
) -> Iterator[Stack]:
    """Starts the named services in order with one data dir and stops them afterwards."""
    data_dir.mkdir(parents=True, exist_ok=True)
    env = base_env(data_dir, **env_overrides)
    env.setdefault("HYATLAS_GO_PORT", str(free_port()))
    stack = Stack(data_dir, env)
    try:
        for service in services:
            stack.start(service)
        yield stack
    finally:
        stack.stop_all()
