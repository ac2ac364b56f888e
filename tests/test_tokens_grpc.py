"""gRPC on TCP needs the service token; a bad tokens file, a bare TCP address or an API open
beyond loopback without a token stops a start."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.errors import ConfigError
from shared.grants import Grant
from shared.owner_state import NOW_ASKED, owner_key
from shared.pb import common_pb2, introspect_pb2, introspect_pb2_grpc, store_pb2, store_pb2_grpc
from shared.settings import Settings
from shared.store_client import owner_state_op
from tests.support import ROOT, Stack, base_env, free_port, grpc_serving, running_stack

pytestmark = pytest.mark.slow

SERVICE_TOKEN = "grpc-service-secret-0123456789"
TOKEN = (("authorization", f"bearer {SERVICE_TOKEN}"),)
AS_CAROL = (*TOKEN, ("x-hyatlas-grant", Grant.build(
    "carol-app", ["grpc-carol"], ["*"], ["read", "write"]).header()))


@pytest.fixture(scope="module")
def tcp_stack(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    """Store and search on TCP with a service token; the gateway reaches both with it."""
    with running_stack(
        tmp_path_factory.mktemp("tokens-tcp"),
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_STORE_ADDR=f"127.0.0.1:{free_port()}",
        HYATLAS_SEARCH_ADDR=f"127.0.0.1:{free_port()}",
        HYATLAS_GRPC_TOKEN=SERVICE_TOKEN,
    ) as stack:
        yield stack


def _owners(stack: Stack, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    with grpc.insecure_channel(stack.address("store")) as channel:
        try:
            store_pb2_grpc.StoreStub(channel).ListOwners(
                store_pb2.ListOwnersRequest(scope=common_pb2.Scope(all_users=True)),
                metadata=metadata, timeout=30,
            )
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_a_tcp_call_without_the_service_token_is_refused(tcp_stack: Stack) -> None:
    assert _owners(tcp_stack, ()) == grpc.StatusCode.UNAUTHENTICATED
    wrong = (("authorization", f"bearer {SERVICE_TOKEN}x"),)
    assert _owners(tcp_stack, wrong) == grpc.StatusCode.UNAUTHENTICATED
    right = (("authorization", f"bearer {SERVICE_TOKEN}"),)
    assert _owners(tcp_stack, right) == grpc.StatusCode.OK
    # A supervisor checks health without the token.
    assert grpc_serving(tcp_stack.address("store"))


def _insert(user: str) -> store_pb2.ApplyRequest:
    return store_pb2.ApplyRequest(scope=common_pb2.Scope(user_id=user), actor="api", ops=[
        store_pb2.Op(insert=store_pb2.NewMemory(
            owner=common_pb2.Owner(user_id=user), layer=common_pb2.L2_RAW,
            content=f"{user} keeps bees"))])


def test_the_store_enforces_the_grant_a_call_carries(tcp_stack: Stack) -> None:
    with grpc.insecure_channel(tcp_stack.address("store")) as channel:
        store = store_pb2_grpc.StoreStub(channel)
        for user in ("grpc-carol", "grpc-dave"):
            store.Apply(_insert(user), metadata=TOKEN, timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            store.Apply(_insert("grpc-dave"), metadata=AS_CAROL, timeout=30)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        every = common_pb2.Scope(all_users=True)
        owners = store.ListOwners(store_pb2.ListOwnersRequest(scope=every),
                                  metadata=AS_CAROL, timeout=30)
        assert [o.user_id for o in owners.owners] == ["grpc-carol"]
        dave = store.ListOwners(store_pb2.ListOwnersRequest(
            scope=common_pb2.Scope(user_id="grpc-dave")), metadata=TOKEN, timeout=30)
        assert [o.live for o in dave.owners] == [1]


def test_a_call_carrying_two_grants_or_two_tokens_is_refused(tcp_stack: Stack) -> None:
    # One could be read over the other: a grant for everyone after carol's listed every owner.
    everyone = ("x-hyatlas-grant", Grant.build("any", ["*"], ["*"], ["read"]).header())
    assert _owners(tcp_stack, (*AS_CAROL, everyone)) == grpc.StatusCode.UNAUTHENTICATED
    assert _owners(tcp_stack, (*TOKEN, *TOKEN)) == grpc.StatusCode.UNAUTHENTICATED
    assert _owners(tcp_stack, AS_CAROL) == grpc.StatusCode.OK


def test_a_grant_naming_its_owners_other_than_as_a_list_of_names_is_refused(
    tcp_stack: Stack,
) -> None:
    # A string was read a character a name: "u6" as the users u and 6.
    for users, agents in (("u6", ["*"]), (["u6"], "a1"), (["u6", 6], ["*"])):
        grant = json.dumps({"name": "u6-app", "audited": True, "users": users, "agents": agents})
        refused = _owners(tcp_stack, (*TOKEN, ("x-hyatlas-grant", grant)))
        assert refused == grpc.StatusCode.INVALID_ARGUMENT, (users, agents)
    listed = json.dumps({"name": "u6-app", "audited": True, "users": ["u6"], "agents": None})
    assert _owners(tcp_stack, (*TOKEN, ("x-hyatlas-grant", listed))) == grpc.StatusCode.OK


def test_a_call_with_a_grant_for_some_owners_is_refused_the_servers_state(
    tcp_stack: Stack,
) -> None:
    set_state = store_pb2.ApplyRequest(
        scope=common_pb2.Scope(user_id="grpc-carol"), actor="api",
        ops=[store_pb2.Op(set_state=store_pb2.SetStateOp(key="probe:x", value_json='"carol"'))],
    )
    with grpc.insecure_channel(tcp_stack.address("store")) as channel:
        store = store_pb2_grpc.StoreStub(channel)
        store.Apply(set_state, metadata=TOKEN, timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            store.GetState(store_pb2.GetStateRequest(prefix=""), metadata=AS_CAROL, timeout=30)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        changed = store_pb2.ApplyRequest()
        changed.CopyFrom(set_state)
        changed.ops[0].set_state.value_json = '"overwritten"'
        with pytest.raises(grpc.RpcError) as refused:
            store.Apply(changed, metadata=AS_CAROL, timeout=30)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        kept = store.GetState(store_pb2.GetStateRequest(prefix="probe:"), metadata=TOKEN,
                              timeout=30)
    assert [(v.key, v.value_json) for v in kept.values] == [("probe:x", '"carol"')]


def test_a_grant_for_some_owners_sets_a_state_key_of_its_owner_with_its_write_and_no_other(
    tcp_stack: Stack,
) -> None:
    # An extraction runs under its writer's grant: the Now page request it stores with the
    # turn's facts, in the same transaction, is the owner's, not the server's.
    def write(owner: str) -> store_pb2.ApplyRequest:
        request = _insert("grpc-carol")
        request.ops.append(owner_state_op(NOW_ASKED, owner, "", {"asked": "x"}))
        return request

    with grpc.insecure_channel(tcp_stack.address("store")) as channel:
        store = store_pb2_grpc.StoreStub(channel)
        store.Apply(write("grpc-carol"), metadata=AS_CAROL, timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            store.Apply(write("grpc-dave"), metadata=AS_CAROL, timeout=30)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        kept = store.GetState(store_pb2.GetStateRequest(prefix=f"{NOW_ASKED}/"), metadata=TOKEN,
                              timeout=30)
    assert [(v.key, v.value_json) for v in kept.values] == [
        (owner_key(NOW_ASKED, "grpc-carol", ""), '{"asked":"x"}')
    ]


def test_a_grant_for_some_owners_takes_no_lease_and_sees_no_store_wide_count(
    tcp_stack: Stack,
) -> None:
    # A lease names work on any owner (an owner's extractions): a caller that could take one
    # could stop another user's; the vector count is the whole store's.
    name = 'extraction/["grpc-dave",""]'
    claim = store_pb2.ClaimLeaseRequest(name=name, holder="carol's", ttl_s=600.0)
    with grpc.insecure_channel(tcp_stack.address("store")) as channel:
        store = store_pb2_grpc.StoreStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            store.ClaimLease(claim, metadata=AS_CAROL, timeout=30)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        ours = store_pb2.ClaimLeaseRequest(name=name, holder="a replica", ttl_s=0.0)
        free = store.ClaimLease(ours, metadata=TOKEN, timeout=30)
        assert (free.granted, free.holder) == (True, "")
        assert not store.Flush(store_pb2.FlushRequest(), metadata=AS_CAROL,
                               timeout=30).HasField("vectors")
        assert store.Flush(store_pb2.FlushRequest(), metadata=TOKEN, timeout=30).HasField(
            "vectors")


def _imported(store: store_pb2_grpc.StoreStub, user: str, *rows: dict[str, object]) -> None:
    """Imports rows for user as a caller holding carol's grant (an import may name any id)."""
    lines = [store_pb2.ImportLine(line=n, json=json.dumps(
        {"type": "memory", "memory": {"user_id": user, **row}})) for n, row in enumerate(rows, 1)]
    reply = store.ImportRows(store_pb2.ImportRowsRequest(
        scope=common_pb2.Scope(user_id=user), lines=lines), metadata=AS_CAROL, timeout=60)
    assert not reply.errors, reply.errors


def _added(store: store_pb2_grpc.StoreStub, user: str, text: str, **fields: object) -> str:
    reply = store.Apply(store_pb2.ApplyRequest(
        scope=common_pb2.Scope(user_id=user), actor="api", ops=[store_pb2.Op(
            insert=store_pb2.NewMemory(owner=common_pb2.Owner(user_id=user),
                                       layer=common_pb2.L3_FACT, content=text, **fields))]),
        metadata=TOKEN, timeout=30)
    return reply.memories[0].id  # type: ignore[no-any-return]


def _as_carol(store: store_pb2_grpc.StoreStub, op: store_pb2.Op) -> None:
    """One op applied for grpc-carol under carol's grant."""
    store.Apply(store_pb2.ApplyRequest(
        scope=common_pb2.Scope(user_id="grpc-carol"), actor="api", ops=[op]),
        metadata=AS_CAROL, timeout=30)


def test_a_row_another_user_named_as_its_replacement_shows_nothing_of_theirs(
    tcp_stack: Stack,
) -> None:
    # An import may write any id in superseded_by or metadata.mirror_of: the row named there is
    # another user's, which neither side may see or depend on.
    with grpc.insecure_channel(tcp_stack.address("store")) as channel:
        store = store_pb2_grpc.StoreStub(channel)
        bob = _added(store, "grpc-bob", "Bob's blood test results are pending")
        _imported(store, "grpc-carol", {
            "id": "carol-older", "content": "PLANTED BY CAROL", "layer": "l3_fact",
            "status": "retired", "superseded_how": "replaced", "superseded_by": bob,
            "invalid_at": 1796600000,
        }, {
            "id": "carol-mirror", "content": "likes tea", "layer": "l1_profile",
            "status": "retired", "superseded_how": "replaced", "invalid_at": 1796600000,
            "metadata": {"mirror_of": bob},
        })
        body = json.dumps({"query": "blood test results pending", "user_id": "grpc-bob"})
        request = urllib.request.Request(tcp_stack.base_url + "/api/v1/search",
                                         data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            found = json.loads(reply.read())["memories"]["normal"]
        assert [m["content"] for m in found] == ["Bob's blood test results are pending"]
        assert "PLANTED BY CAROL" not in json.dumps(found)

        def restore(row: str) -> None:
            _as_carol(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=row)))

        restore("carol-older")  # bob's live row is no replacement of carol's
        with pytest.raises(grpc.RpcError) as refused:
            restore("carol-mirror")
        assert f"it mirrors preference fact {bob!r}, which is deleted" in (
            refused.value.details() or "")


def test_an_update_condition_on_another_users_row_is_not_found_whatever_it_guesses(
    tcp_stack: Stack,
) -> None:
    with grpc.insecure_channel(tcp_stack.address("store")) as channel:
        store = store_pb2_grpc.StoreStub(channel)
        bob = _added(store, "grpc-bob", "Bob's PIN is 4711")
        for guess in ("Bob's PIN is 4711", "Bob's PIN is 1234"):
            with pytest.raises(grpc.RpcError) as refused:
                _as_carol(store, store_pb2.Op(update=store_pb2.UpdateOp(
                    id=bob, hits_delta=1, require=store_pb2.Unchanged(content=guess))))
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND, guess


def test_an_id_erased_then_imported_by_another_user_carries_none_of_the_old_history(
    tcp_stack: Stack,
) -> None:
    with grpc.insecure_channel(tcp_stack.address("store")) as channel:
        store = store_pb2_grpc.StoreStub(channel)
        _added(store, "grpc-bob", "Bob's old address", id="reused-id")
        store.Apply(store_pb2.ApplyRequest(
            scope=common_pb2.Scope(user_id="grpc-bob"), actor="api",
            ops=[store_pb2.Op(delete=store_pb2.DeleteOp(id="reused-id"))]),
            metadata=TOKEN, timeout=30)
        _imported(store, "grpc-carol", {"id": "reused-id", "content": "Carol's own note"})
        carol = common_pb2.Scope(user_id="grpc-carol")
        history = store.GetHistory(store_pb2.GetHistoryRequest(scope=carol, id="reused-id"),
                                   metadata=AS_CAROL, timeout=30)
        assert [e.action for e in history.entries] == ["insert"]
        page = store.ExportPage(store_pb2.ExportPageRequest(scope=carol), metadata=AS_CAROL,
                                timeout=30)
        exported = [json.loads(line) for line in page.lines]
        assert "Bob's old address" not in json.dumps(exported)
        (line,) = [e for e in exported if e["memory"]["id"] == "reused-id"]
        assert [e["action"] for e in line["history"]] == ["insert"]


def test_a_grant_for_some_owners_sees_no_store_wide_figures(tcp_stack: Stack) -> None:
    with grpc.insecure_channel(tcp_stack.address("store")) as channel:
        store = store_pb2_grpc.StoreStub(channel)
        every = common_pb2.Scope(all_users=True)
        whole = store.GetStats(store_pb2.GetStatsRequest(scope=every), metadata=TOKEN, timeout=30)
        assert whole.db_bytes > 0 and whole.data_dir
        some = store.GetStats(store_pb2.GetStatsRequest(scope=every), metadata=AS_CAROL,
                              timeout=30)
        assert (some.db_bytes, some.data_dir) == (0, "")
        introspect = introspect_pb2_grpc.IntrospectStub(channel)
        for call, request in ((introspect.GetMetrics, introspect_pb2.GetMetricsRequest()),
                              (introspect.GetRpcCounts, introspect_pb2.GetRpcCountsRequest())):
            with pytest.raises(grpc.RpcError) as refused:
                call(request, metadata=AS_CAROL, timeout=30)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            call(request, metadata=TOKEN, timeout=30)


def test_reflection_on_tcp_needs_the_service_token(tcp_stack: Stack) -> None:
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.insecure_channel(tcp_stack.address("store")) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ServerReflectionInfo(iter([ask]), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = (("authorization", f"bearer {SERVICE_TOKEN}"),)
        answers = list(stub.ServerReflectionInfo(iter([ask]), metadata=metadata, timeout=30))
    names = [s.name for s in answers[0].list_services_response.service]
    assert "hyatlas.v1.Store" in names


async def test_the_services_call_each_other_over_tcp_with_the_token(tcp_stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(tcp_stack.base_url + "/api/v1/add", json={
            "text": "the lighthouse keeper paints the door red", "user_id": "tcp-user",
        }) as reply:
            assert reply.status == 200, await reply.text()
        # The gateway calls search, and search calls the store, both over TCP.
        async with session.post(tcp_stack.base_url + "/api/v1/search", json={
            "query": "lighthouse door", "user_id": "tcp-user",
        }) as reply:
            assert reply.status == 200, await reply.text()
            body = await reply.json()
    hits = [item for items in body["memories"].values() for item in items]
    assert any("lighthouse" in hit["content"] for hit in hits), body


def test_a_tcp_address_without_a_service_token_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="HYATLAS_STORE_ADDR='127.0.0.1:5000'.*GRPC_TOKEN"):
        Settings.from_env({"HYATLAS_STORE_ADDR": "127.0.0.1:5000"})
    settings = Settings.from_env(
        {"HYATLAS_STORE_ADDR": "127.0.0.1:5000", "HYATLAS_GRPC_TOKEN": SERVICE_TOKEN}
    )
    assert settings.grpc_token == SERVICE_TOKEN


NO_API_TOKEN = "is not a loopback address: set HYATLAS_TOKEN or HYATLAS_TOKENS_FILE"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "192.168.1.9", "nas.local"])
def test_a_gateway_host_beyond_loopback_without_an_api_token_is_a_config_error(
    host: str,
) -> None:
    with pytest.raises(ConfigError, match=f"HYATLAS_GO_HOST=.* {NO_API_TOKEN}"):
        Settings.from_env({"HYATLAS_GO_HOST": host})
    for token in ({"HYATLAS_TOKEN": "api-secret-0123456789"},
                  {"HYATLAS_TOKENS_FILE": "/etc/hyatlas/tokens.json"}):
        assert Settings.from_env({"HYATLAS_GO_HOST": host, **token}).http_host == host.strip("[]")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "LOCALHOST.", "::1",
                                  "[::1]"])
def test_a_loopback_gateway_host_needs_no_api_token(host: str) -> None:
    assert Settings.from_env({"HYATLAS_GO_HOST": host}).token == ""


def test_a_gateway_on_all_interfaces_starts_only_with_an_api_token(tmp_path: Path) -> None:
    env = base_env(tmp_path, HYATLAS_GO_HOST="0.0.0.0", HYATLAS_GO_PORT=str(free_port()))
    done = subprocess.run(
        [sys.executable, "-m", "gateway"], cwd=ROOT, env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert f"HYATLAS_GO_HOST='0.0.0.0' {NO_API_TOKEN}".encode() in done.stderr
    with running_stack(tmp_path / "with-token", ["gateway"], HYATLAS_GO_HOST="0.0.0.0",
                       HYATLAS_TOKEN="api-secret-0123456789") as stack:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(stack.base_url + "/api/v1/status", timeout=10)
        refused.value.close()
        assert refused.value.code == 401


@pytest.mark.parametrize("text", [
    '{"tokens": [',
    '{"tokens": [{"name": "x", "token": "short", "users": ["*"], "agents": ["*"],'
    ' "scopes": ["read"]}]}',
    '{"tokens": [{"name": "x", "token": "long-enough-secret-123", "users": ["alice"],'
    ' "agents": ["*"], "scopes": ["admin"]}]}',
    '{"tokens": [{"name": "x", "token": "long-enough-secret-123", "users": ["alice"],'
    ' "agents": ["*"], "scopes": ["delete"]}]}',
])
def test_a_bad_tokens_file_stops_the_gateway_naming_the_variable(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(text)
    env = base_env(tmp_path, HYATLAS_TOKENS_FILE=str(path), HYATLAS_GO_PORT=str(free_port()))
    done = subprocess.run(
        [sys.executable, "-m", "gateway"], cwd=ROOT, env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert b"HYATLAS_TOKENS_FILE=" in done.stderr
