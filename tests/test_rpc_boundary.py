"""The one error boundary: a ServiceError crosses gRPC as itself; a bug crosses as an id only."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from shared.errors import (
    Conflict,
    Internal,
    InvalidArgument,
    NotFound,
    Overloaded,
    PermissionDenied,
    ServiceError,
    StorageFull,
    TooLarge,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from shared.pb import common_pb2
from shared.rpc import ServiceClient, grpc_errors, open_channel, running_grpc_server

ERRORS = [InvalidArgument, Unauthenticated, PermissionDenied, NotFound, Conflict, TooLarge,
          Unimplemented, Unavailable, Overloaded, StorageFull]
METHOD = "/hyatlas.test.Boundary/Fail"


class Failing:
    """A servicer method that raises whatever the test puts in `raise_`."""

    def __init__(self) -> None:
        self.raise_: Callable[[], BaseException] = lambda: RuntimeError("unset")

    @grpc_errors
    async def fail(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise self.raise_()


class Stub:
    """A raw stub for the one method (bytes in, bytes out)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.Fail = channel.unary_unary(METHOD)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Failing, ServiceClient]]:
    failing = Failing()
    handler = grpc.method_handlers_generic_handler("hyatlas.test.Boundary", {
        "Fail": grpc.unary_unary_rpc_method_handler(failing.fail),
    })

    def register(server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers((handler,))
        return []

    address = f"unix:{tmp_path / 'boundary.sock'}"
    async with running_grpc_server(address, register), open_channel(address) as channel:
        yield failing, ServiceClient(Stub(channel), "boundary")


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: e.__name__)
async def test_a_service_error_reaches_the_caller_as_the_same_class_and_http_status(
    served: tuple[Failing, ServiceClient], error: type[ServiceError]
) -> None:
    failing, client = served
    failing.raise_ = lambda: error("what went wrong")
    with pytest.raises(error) as caught:
        await client.Fail(b"", timeout=30)
    assert caught.value.message == "boundary: what went wrong"
    assert caught.value.http_status == error.http_status


async def test_an_unexpected_exception_reaches_the_caller_as_an_id_without_its_text(
    served: tuple[Failing, ServiceClient], caplog: pytest.LogCaptureFixture
) -> None:
    failing, client = served
    failing.raise_ = lambda: KeyError("secret-detail-of-a-bug")
    with pytest.raises(Internal) as caught:
        await client.Fail(b"", timeout=30)
    assert caught.value.http_status == 500
    assert "secret-detail" not in caught.value.message
    error_id = caught.value.message.rsplit("id ", 1)[1].rstrip(")")
    # The log has the whole story under the id the caller was given.
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None
    assert "secret-detail-of-a-bug" in str(logged[0].exc_info[1])


async def test_a_request_that_is_not_its_message_is_invalid_argument_and_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    served: list[common_pb2.Scope] = []

    async def echo(request: common_pb2.Scope, context: grpc.aio.ServicerContext) -> bytes:
        served.append(request)
        return b""

    handler = grpc.method_handlers_generic_handler("hyatlas.test.Boundary", {
        "Fail": grpc.unary_unary_rpc_method_handler(
            echo, request_deserializer=common_pb2.Scope.FromString),
    })

    def register(server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers((handler,))
        return []

    address = f"unix:{tmp_path / 'decode.sock'}"
    async with running_grpc_server(address, register), open_channel(address) as channel:
        client = ServiceClient(Stub(channel), "boundary")
        bad_utf8 = b"\x0a\x03\xff\xfe\xed"  # field 1 (user_id), a string of bytes not UTF-8
        with pytest.raises(InvalidArgument) as caught:
            await client.Fail(bad_utf8, timeout=30)
        assert "a malformed request:" in caught.value.message
        with pytest.raises(InvalidArgument):
            await client.Fail(b"\x0a\x09abc", timeout=30)  # a string cut short
        await client.Fail(common_pb2.Scope(user_id="ok").SerializeToString(), timeout=30)
    assert [scope.user_id for scope in served] == ["ok"]
    assert not [r for r in caplog.records if r.exc_info]
