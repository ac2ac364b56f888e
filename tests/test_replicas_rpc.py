"""An address may list several replicas: calls take turns, and a crashed replica drops out."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.config import GatewayConfig
from services.embedder.config import EmbedderConfig
from services.extractor.config import ExtractorConfig
from services.search.config import SearchConfig
from services.store.config import StoreConfig
from shared.addresses import channel_target, endpoints
from shared.errors import ConfigError
from shared.pb import (
    common_pb2,
    embedder_pb2,
    embedder_pb2_grpc,
    introspect_pb2,
    introspect_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)
from shared.rpc import open_channel, wait_serving
from shared.settings import Settings
from tests.support import ServiceProcess, assert_eventually, base_env, free_port, grpc_serving

TOKEN = "replica-service-token-0123456789"
EMBED = "/hyatlas.v1.Embedder/Embed"
APPLY = "/hyatlas.v1.Store/Apply"
SCOPE = common_pb2.Scope(user_id="alice")

Replicas = tuple[str, str, dict[str, ServiceProcess]]
"""The comma-separated address, the service token and each endpoint's process."""


# Addresses and targets.


@pytest.mark.parametrize(
    ("address", "target"),
    [
        ("unix:/run/a.sock", "unix:/run/a.sock"),
        ("unix:/run/a.sock, unix:///run/b.sock", "unix:/run/a.sock,/run/b.sock"),
        ("10.0.0.1:7001,10.0.0.2:7001", "ipv4:10.0.0.1:7001,10.0.0.2:7001"),
        ("[fd00::1]:7001,[fd00::2]:7001", "ipv6:[fd00::1]:7001,[fd00::2]:7001"),
        ("store.internal:7001", "store.internal:7001"),
        ("10.0.0.1:7001,", "10.0.0.1:7001"),
    ],
)
def test_an_address_becomes_the_target_grpc_balances(address: str, target: str) -> None:
    assert channel_target(address) == target


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("unix:/run/a.sock,10.0.0.2:7001", "mixes unix sockets and TCP"),
        ("10.0.0.1:7001,[fd00::2]:7001", "mixes IPv4 and IPv6"),
        ("store-a:7001,store-b:7001", "not a host name"),
        ("10.0.0.1:7001,10.0.0.2", "must be IP:PORT"),
        ("10.0.0.1:7001, 10.0.0.1:7001", "names 10.0.0.1:7001 twice"),
    ],
)
def test_a_list_grpc_cannot_balance_is_refused_at_start(address: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=f"HYATLAS_STORE_ADDR=.*{reason}"):
        Settings.from_env({"HYATLAS_STORE_ADDR": address, "HYATLAS_GRPC_TOKEN": TOKEN})


def test_a_replica_of_a_list_serves_on_the_endpoint_it_is_told() -> None:
    env = {
        "HYATLAS_STORE_ADDR": "10.0.0.1:7001,10.0.0.2:7001",
        "HYATLAS_STORE_LISTEN": "0.0.0.0:7001",
        "HYATLAS_EMBEDDER_ADDR": "10.0.0.1:7000,10.0.0.2:7000",
        "HYATLAS_GRPC_TOKEN": TOKEN,
    }
    config = StoreConfig.from_env(env)
    assert config.address == "0.0.0.0:7001"
    assert config.embedder_address == "10.0.0.1:7000,10.0.0.2:7000"
    # The gateway serves no gRPC: lists without a LISTEN are all it needs.
    assert GatewayConfig.from_env(env).store_address == "10.0.0.1:7001,10.0.0.2:7001"


def test_a_replica_not_told_its_own_endpoint_refuses_to_start() -> None:
    env = {"HYATLAS_EMBEDDER_ADDR": "unix:/run/a.sock,unix:/run/b.sock"}
    with pytest.raises(ConfigError, match="set HYATLAS_EMBEDDER_LISTEN to the one"):
        EmbedderConfig.from_env(env)


def test_a_numbered_replica_serves_on_its_entry_of_the_list() -> None:
    env = {"HYATLAS_STORE_ADDR": "unix:/run/s0.sock,unix:/run/s1.sock"}
    assert StoreConfig.from_env({**env, "HYATLAS_STORE_REPLICA": "1"}).address == (
        "unix:/run/s1.sock"
    )
    with pytest.raises(ConfigError, match="HYATLAS_STORE_REPLICA='2' is outside 0..1"):
        Settings.from_env({**env, "HYATLAS_STORE_REPLICA": "2"})


def test_a_listen_endpoint_is_one_endpoint() -> None:
    env = {"HYATLAS_EMBEDDER_LISTEN": "unix:/run/a.sock,unix:/run/b.sock"}
    with pytest.raises(ConfigError, match="HYATLAS_EMBEDDER_LISTEN=.*one endpoint"):
        Settings.from_env(env)


@pytest.mark.parametrize(
    "env",
    [
        {"HYATLAS_STORE_ADDR": "unix:/run/a.sock,unix:/run/b.sock",
         "HYATLAS_STORE_LISTEN": "127.0.0.1:7001"},
        {"HYATLAS_STORE_ADDR": "10.0.0.1:7001,10.0.0.2:7001"},
    ],
)
def test_a_tcp_endpoint_anywhere_needs_the_service_token(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="is a TCP address: set HYATLAS_GRPC_TOKEN"):
        Settings.from_env(env)


# Real replicas behind one address.


@contextlib.contextmanager
def running_replicas(
    service: str, own: list[str], env: dict[str, str], logs: Path
) -> Iterator[dict[str, ServiceProcess]]:
    """One process of service per endpoint, each serving on its own, all named by one address."""
    variable = f"HYATLAS_{service.upper()}"
    env = {**env, f"{variable}_ADDR": ",".join(own)}
    procs: dict[str, ServiceProcess] = {}
    try:
        for index, endpoint in enumerate(own):
            procs[endpoint] = ServiceProcess(
                f"services.{service}", {**env, f"{variable}_LISTEN": endpoint},
                functools.partial(grpc_serving, endpoint), logs / f"{service}-{index}.log",
            ).start()
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _two_endpoints(tmp_path: Path, kind: str) -> tuple[list[str], dict[str, str]]:
    """Two endpoints of one kind (unix or tcp) and the settings that kind needs."""
    if kind == "unix":
        return [f"unix:{tmp_path / 'a.sock'}", f"unix:{tmp_path / 'b.sock'}"], {}
    own = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    return own, {"HYATLAS_GRPC_TOKEN": TOKEN}


@pytest.fixture(params=["unix", "tcp"])
def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Replicas]:
    """Two embedder processes, each on its own endpoint of one comma-separated address."""
    own, extra = _two_endpoints(tmp_path, request.param)
    env = base_env(tmp_path, HYATLAS_EMBED_BASE="local", **extra)
    with running_replicas("embedder", own, env, tmp_path) as procs:
        yield ",".join(own), extra.get("HYATLAS_GRPC_TOKEN", ""), procs


async def _calls_answered(endpoint: str, method: str, token: str = "") -> int:
    """How many calls of method the one server at endpoint has answered."""
    async with open_channel(endpoint, token) as channel:
        reply = await introspect_pb2_grpc.IntrospectStub(channel).GetRpcCounts(
            introspect_pb2.GetRpcCountsRequest(), timeout=5
        )
    return reply.counts.get(method, 0)


async def _embed(channel: grpc.aio.Channel, count: int) -> None:
    stub = embedder_pb2_grpc.EmbedderStub(channel)
    for n in range(count):
        reply = await stub.Embed(embedder_pb2.EmbedRequest(texts=[f"text {n}"]), timeout=5)
        assert len(reply.vectors) == 1


async def _succeeding(call: Callable[[], Awaitable[Any]]) -> Any:
    """call's result; a failed call is an AssertionError, so assert_eventually tries again."""
    try:
        return await call()
    except grpc.aio.AioRpcError as exc:
        raise AssertionError(f"a call failed: {exc.code().name} {exc.details()}") from exc


async def test_calls_take_turns_across_replicas_and_skip_one_killed(
    replicas: Replicas,
) -> None:
    address, token, procs = replicas
    first, second = endpoints(address)
    await wait_serving(address, timeout_s=10)
    async with open_channel(address, token) as channel:
        # Round robin sends to every connected replica; both connect soon after the first call.
        async def both_answered() -> None:
            await _embed(channel, 4)
            assert await _calls_answered(first, EMBED, token) > 0
            assert await _calls_answered(second, EMBED, token) > 0

        await assert_eventually(both_answered)

        procs[first].kill()
        before = await _calls_answered(second, EMBED, token)
        # Calls already sent to the killed replica fail until gRPC sees it gone; then all succeed.
        await assert_eventually(lambda: _succeeding(lambda: _embed(channel, 6)))
        await _embed(channel, 10)
        assert await _calls_answered(second, EMBED, token) >= before + 16
    await wait_serving(address, timeout_s=10)


async def test_two_stores_on_one_database_share_every_acknowledged_write(
    tmp_path: Path, pg_databases: Any
) -> None:
    embedder = f"unix:{tmp_path / 'embedder.sock'}"
    env = base_env(tmp_path, HYATLAS_EMBED_BASE="local", HYATLAS_EMBEDDER_ADDR=embedder,
                   HYATLAS_STORE_DSN=pg_databases.new_dsn())
    own, _ = _two_endpoints(tmp_path, "unix")
    with (
        running_replicas("embedder", [embedder], env, tmp_path),
        running_replicas("store", own, env, tmp_path) as stores,
    ):
        async with open_channel(",".join(own)) as channel:
            stub = store_pb2_grpc.StoreStub(channel)

            async def write(text: str) -> None:
                op = store_pb2.Op(insert=store_pb2.NewMemory(
                    owner=common_pb2.Owner(user_id="alice"), layer=common_pb2.L2_RAW,
                    content=text))
                await stub.Apply(store_pb2.ApplyRequest(scope=SCOPE, ops=[op]), timeout=30)

            written = [f"note {n}" for n in range(12)]
            for text in written:
                await write(text)
            assert all([await _calls_answered(endpoint, APPLY) > 0 for endpoint in own])

            stores[own[0]].kill()
            # A write sent to the killed store before gRPC noticed may fail: it was never
            # acknowledged. Every acknowledged one is in the database the other store reads.
            for text in (f"after {n}" for n in range(6)):
                await assert_eventually(lambda text=text: _succeeding(lambda: write(text)))
                written.append(text)
            reply = await stub.ListMemories(
                store_pb2.ListMemoriesRequest(scope=SCOPE, limit=1000), timeout=30
            )
    assert sorted(memory.content for memory in reply.memories) == sorted(written)


# The two-node layout in deploy/ starts as its README says.

TWO_NODE = Path(__file__).resolve().parent.parent / "deploy" / "two-node"


def _env_file(path: Path) -> dict[str, str]:
    """The KEY=VALUE lines of a systemd EnvironmentFile."""
    lines = path.read_text().splitlines()
    pairs = [line.split("=", 1) for line in lines if line.strip() and not line.startswith("#")]
    return {key.strip(): value.strip() for key, value in pairs}


@pytest.mark.parametrize(("node", "ip"), [("node-a", "10.0.0.1"), ("node-b", "10.0.0.2")])
def test_each_node_of_the_two_node_layout_serves_its_own_entry_of_every_list(
    node: str, ip: str
) -> None:
    env = {**_env_file(TWO_NODE / "cluster.env"), **_env_file(TWO_NODE / f"{node}.env")}
    settings = Settings.from_env(env)
    own = {
        "embedder": EmbedderConfig.from_env(env).address,
        "store": StoreConfig.from_env(env).address,
        "search": SearchConfig.from_env(env).address,
        "extractor": ExtractorConfig.from_env(env).address,
    }
    for service, address in own.items():
        assert address.startswith(f"{ip}:")
        assert address in endpoints(settings.address(service))
    assert StoreConfig.from_env(env).store_dsn.startswith("postgresql://")
    assert settings.http_host == ip
    # The one consolidator runs on node A; node B's gateway calls it there.
    assert endpoints(settings.address("consolidator")) == ["10.0.0.1:7004"]
