"""gRPC plumbing every service uses: serving with health and reflection, errors, channels."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.errors import ServiceError, error_for_status
from shared.pb import introspect_pb2, introspect_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Services start in any order: a channel retries a peer that is not up yet within a second,
    # not after gRPC's default backoff of up to two minutes. (Not min_reconnect_backoff_ms: gRPC
    # also takes it as the time one connection attempt may take, 20 s by default; a short one
    # fails connections to a busy process on a loaded machine.)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def grpc_errors(method: F) -> F:
    """Sends a ServiceError raised by a servicer method as its gRPC status.

    Any other exception is a bug: it is logged with an id, and the caller gets only that id.
    """

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("%s failed (error id %s)", method.__qualname__, error_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error (id {error_id})")

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def rpc_errors(service: str) -> Iterator[None]:
    """The one boundary for calls out: a failed call raises the ServiceError of its status."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        detail = exc.details() or exc.code().name.lower()
        raise error_for_status(exc.code(), f"{service}: {detail}") from exc


class ServiceClient:
    """A service's gRPC stub whose calls raise ServiceErrors, never AioRpcError."""

    def __init__(self, stub: Any, service: str) -> None:
        self._stub = stub
        self._service = service

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self._stub, name)
        service = self._service

        async def call(*args: Any, **kwargs: Any) -> Any:
            with rpc_errors(service):
                return await method(*args, **kwargs)

        return call


class _RpcCounter(grpc.aio.ServerInterceptor):
    """Counts the calls a server answers, per method (its own plumbing left out)."""

    PLUMBING = ("/grpc.health.", "/grpc.reflection.", "/hyatlas.v1.Introspect/")

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method  # type: ignore[attr-defined]
        if not method.startswith(self.PLUMBING):
            self.counts[method] += 1
        return await continuation(handler_call_details)


class _Introspect(introspect_pb2_grpc.IntrospectServicer):
    def __init__(self, counter: _RpcCounter) -> None:
        self._counter = counter

    async def GetRpcCounts(
        self, request: introspect_pb2.GetRpcCountsRequest, context: grpc.aio.ServicerContext
    ) -> introspect_pb2.GetRpcCountsResponse:
        return introspect_pb2.GetRpcCountsResponse(counts=dict(self._counter.counts))


def _unix_path(address: str) -> Path | None:
    if not address.startswith("unix:"):
        return None
    path = address[len("unix:") :]
    while path.startswith("//"):
        path = path[1:]
    return Path(path)


@contextlib.asynccontextmanager
async def running_grpc_server(
    address: str,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    *,
    grace_s: float = 5.0,
) -> AsyncIterator[tuple[grpc.aio.Server, str]]:
    """Serves the servicers `register` adds (it returns their full service names).

    Yields the server and the bound address (a TCP port of 0 is replaced by the real one).
    On exit gRPC health turns NOT_SERVING first, then the server stops with a grace period.
    """
    counter = _RpcCounter()
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=[counter])
    names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    introspect_pb2_grpc.add_IntrospectServicer_to_server(_Introspect(counter), server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            introspect_pb2.DESCRIPTOR.services_by_name["Introspect"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    sock = _unix_path(address)
    if sock is not None:
        sock.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
    port = server.add_insecure_port(address)
    bound = address
    if sock is None and address.rsplit(":", 1)[-1] == "0":
        bound = f"{address.rsplit(':', 1)[0]}:{port}"
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s", ", ".join(names), bound)
    try:
        yield server, bound
    finally:
        for name in ["", *names]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace_s)
        if sock is not None:
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()
        log.info("stopped %s", ", ".join(names))


def open_channel(address: str) -> grpc.aio.Channel:
    """An insecure channel to a service address (unix:PATH or HOST:PORT)."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def health_state(channel: grpc.aio.Channel, timeout_s: float = 1.0, service: str = "") -> str:
    """What gRPC health says of the server behind channel: serving, not_serving or unreachable."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    except grpc.aio.AioRpcError:
        return "unreachable"
    return "serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "not_serving"


async def wait_serving(address: str, timeout_s: float = 30.0, service: str = "") -> None:
    """Waits until the service at address reports SERVING on gRPC health."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with open_channel(address) as channel:
        while True:
            if await health_state(channel, service=service) == "serving":
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{address} did not report SERVING within {timeout_s}s")
            await asyncio.sleep(0.05)
