"""gRPC plumbing every service uses: serving with health and reflection, errors, channels."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc
import prometheus_client
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from shared.addresses import balancing, channel_target, unix_path
from shared.errors import ServiceError, error_for_status
from shared.grants import CURRENT_GRANT, Grant, check_everyone
from shared.limits import MAX_MESSAGE_BYTES
from shared.pb import introspect_pb2, introspect_pb2_grpc

log = logging.getLogger(__name__)

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
# Trailing metadata naming a ServiceError that shares its gRPC status with another.
ERROR_KIND_KEY = "hyatlas-error-kind"


def grpc_errors(method: F) -> F:
    """Sends a ServiceError raised by a servicer method as its gRPC status.

    Any other exception is a bug: it is logged with an id, and the caller gets only that id.
    """

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except ServiceError as exc:
            kind = ((ERROR_KIND_KEY, exc.kind),) if exc.kind else ()
            await context.abort(exc.code, exc.message, trailing_metadata=kind)
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
        kind = dict(exc.trailing_metadata() or ()).get(ERROR_KIND_KEY, "")
        raise error_for_status(exc.code(), f"{service}: {detail}", service, str(kind)) from exc


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


LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
"""Histogram buckets for call latency, from a cached read to a long LLM extraction."""


class _Wrappers:
    """The handler an interceptor wraps each method's handler in, built once and kept while the
    handler it wraps is the same object (it is, call after call, unless a call's grant makes a
    new one). Built anew at every call, with the metric series looked up at each, a server's
    CPU a unary call was 525 microseconds against 473 so (medians of ten runs of 3,000 calls
    of an empty method, 2026-12-07)."""

    def __init__(self) -> None:
        self._by_method: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def of(
        self,
        method: str,
        handler: grpc.RpcMethodHandler,
        wrap: Callable[[grpc.RpcMethodHandler], grpc.RpcMethodHandler],
    ) -> grpc.RpcMethodHandler:
        """wrap(handler), from the last call of the method when its handler was this one."""
        kept = self._by_method.get(method)
        if kept is None or kept[0] is not handler:
            kept = (handler, wrap(handler))
            self._by_method[method] = kept
        return kept[1]


class _RpcMeter(grpc.aio.ServerInterceptor):
    """Measures the calls a server answers, per method: count by status, latency, in flight
    (its own plumbing left out). Each server has its own registry, served by Introspect."""

    PLUMBING = ("/grpc.health.", "/grpc.reflection.", "/hyatlas.v1.Introspect/")

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.calls = prometheus_client.Counter(
            "hyatlas_grpc_requests", "gRPC calls answered, by method and status code",
            ["method", "code"], registry=self.registry)
        self.latency = prometheus_client.Histogram(
            "hyatlas_grpc_request_seconds", "Time to answer a gRPC call, by method",
            ["method"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.in_flight = prometheus_client.Gauge(
            "hyatlas_grpc_requests_in_flight", "gRPC calls being answered now, by method",
            ["method"], registry=self.registry)
        self._wrappers = _Wrappers()

    def counts(self) -> dict[str, int]:
        """Calls answered per full method name, whatever their status."""
        counts: collections.Counter[str] = collections.Counter()
        for family in self.calls.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["method"]] += int(sample.value)
        return dict(counts)

    def _measured(self, method: str, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        # The method's own series, looked up once (labels() takes a lock and checks its values).
        in_flight = self.in_flight.labels(method)
        latency = self.latency.labels(method)
        calls: dict[str, Any] = {}

        async def measured(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            in_flight.inc()
            failed = True
            try:
                reply = await behavior(request, context)
                failed = False
                return reply
            finally:
                code = context.code()
                name = code.name if isinstance(code, grpc.StatusCode) else "OK"
                status = "UNKNOWN" if failed and name == "OK" else name
                if status not in calls:
                    calls[status] = self.calls.labels(method, status)
                calls[status].inc()
                latency.observe(time.perf_counter() - started)
                in_flight.dec()

        return measured

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method  # type: ignore[attr-defined]
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(self.PLUMBING) or not handler.unary_unary:
            return handler

        def measuring(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                self._measured(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        return self._wrappers.of(method, handler, measuring)


class _Introspect(introspect_pb2_grpc.IntrospectServicer):
    def __init__(self, meter: _RpcMeter) -> None:
        self._meter = meter

    @grpc_errors
    async def GetRpcCounts(
        self, request: introspect_pb2.GetRpcCountsRequest, context: grpc.aio.ServicerContext
    ) -> introspect_pb2.GetRpcCountsResponse:
        check_everyone("the service's call counts")
        return introspect_pb2.GetRpcCountsResponse(counts=self._meter.counts())

    @grpc_errors
    async def GetMetrics(
        self, request: introspect_pb2.GetMetricsRequest, context: grpc.aio.ServicerContext
    ) -> introspect_pb2.GetMetricsResponse:
        check_everyone("the service's metrics")
        text = prometheus_client.generate_latest(self._meter.registry).decode("utf-8")
        return introspect_pb2.GetMetricsResponse(text=text)


GRANT_METADATA = "x-hyatlas-grant"
"""Call metadata carrying the caller's grant (JSON); a call without it is a service's own work."""
TOKEN_METADATA = "authorization"
"""Call metadata carrying the service token ("bearer TOKEN"), required on TCP addresses."""
# A supervisor checks health without holding the service token.
OPEN_METHODS = ("/grpc.health.v1.Health/",)


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    return grpc.stream_stream_rpc_method_handler(refuse, **serializers)


def _under_grant(
    value: str, behavior: Callable[..., Awaitable[Any]]
) -> Callable[..., Awaitable[Any]]:
    """The behavior run with CURRENT_GRANT set to the grant in value."""

    async def served(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            grant = Grant.from_header(value)
        except ServiceError as exc:
            kind = ((ERROR_KIND_KEY, exc.kind),) if exc.kind else ()
            await context.abort(exc.code, exc.message, trailing_metadata=kind)
        reset = CURRENT_GRANT.set(grant)
        try:
            return await behavior(request, context)
        finally:
            CURRENT_GRANT.reset(reset)

    return served


class _CallGuard(grpc.aio.ServerInterceptor):
    """Refuses calls without the service token (when one is required) and serves each call
    under the grant its metadata carries, so the calls it makes carry that grant on."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _token_ok(self, metadata: dict[str, Any]) -> bool:
        scheme, _, given = str(metadata.get(TOKEN_METADATA, "")).partition(" ")
        # Compared in constant time so the token cannot be guessed byte by byte.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self._token.encode()
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        entries = list(handler_call_details.invocation_metadata or ())  # type: ignore[attr-defined]
        metadata = dict(entries)
        for key in (TOKEN_METADATA, GRANT_METADATA):
            if sum(1 for name, _ in entries if name == key) > 1:
                # Two could be read two ways (a proxy adding its own beside the caller's).
                return _refusal(handler, f"a call with more than one {key} entry is refused")
        if self._token and not method.startswith(OPEN_METHODS) and not self._token_ok(metadata):
            return _refusal(handler, "this address needs the service token (HYATLAS_GRPC_TOKEN)")
        grant = metadata.get(GRANT_METADATA)
        if grant is None or not handler.unary_unary:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            _under_grant(str(grant), handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class _Malformed:
    """What a request whose bytes are not its message reads as; its handler refuses it."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _DecodeGuard(grpc.aio.ServerInterceptor):
    """Answers a request that is not a well-formed message (bad UTF-8 in a string, a cut
    field) with INVALID_ARGUMENT: gRPC's own answer is UNKNOWN with the parser's exception in
    it, and a traceback in the log, as for a bug."""

    def __init__(self) -> None:
        self._wrappers = _Wrappers()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler.unary_unary or handler.request_deserializer is None:
            return handler
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        return self._wrappers.of(method, handler, _refusing_malformed)


def _refusing_malformed(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler, with a request that does not decode refused (see _DecodeGuard)."""
    decode, serve = handler.request_deserializer, handler.unary_unary

    def read(data: bytes) -> Any:
        try:
            return decode(data)
        except DecodeError as exc:
            return _Malformed(str(exc))

    async def refuse_malformed(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"a malformed request: {request.reason}"
            )
        return await serve(request, context)

    return grpc.unary_unary_rpc_method_handler(
        refuse_malformed, request_deserializer=read,
        response_serializer=handler.response_serializer,
    )


class _CallMetadata(grpc.aio.UnaryUnaryClientInterceptor):
    """Sends the service token (if any) and the grant of the call being served (if any)."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        extra = [(TOKEN_METADATA, f"bearer {self._token}")] if self._token else []
        grant = CURRENT_GRANT.get()
        if grant is not None:
            extra.append((GRANT_METADATA, grant.header()))
        if extra:
            metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()), *extra)
            client_call_details = client_call_details._replace(metadata=metadata)
        return await continuation(client_call_details, request)


@contextlib.asynccontextmanager
async def running_grpc_server(
    address: str,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    *,
    grace_s: float = 5.0,
    collectors: Iterable[Collector] = (),
    token: str = "",
    ready: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncIterator[tuple[grpc.aio.Server, str]]:
    """Serves the servicers `register` adds (it returns their full service names) on one
    endpoint, `address` (a replica's own: see Settings.listen_address).

    With `ready`, gRPC health follows it (asked every READY_EVERY_S): NOT_SERVING while what
    the service needs (the store's database) does not answer.

    `collectors` add the service's own figures to the metrics Introspect/GetMetrics serves.
    On a TCP address every call but health needs `token` (unix sockets are guarded by the
    file system).

    Yields the server and the bound address (a TCP port of 0 is replaced by the real one).
    On exit gRPC health turns NOT_SERVING first, then the server stops with a grace period.
    """
    meter = _RpcMeter()
    for collector in collectors:
        meter.registry.register(collector)
    sock = unix_path(address)
    if sock is None and not token:
        log.warning("gRPC on TCP %s without a service token: anyone who can reach it "
                    "reads and changes every memory (set HYATLAS_GRPC_TOKEN)", address)
    guard = _CallGuard(token if sock is None else "")
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=[meter, guard, _DecodeGuard()])
    names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    introspect_pb2_grpc.add_IntrospectServicer_to_server(_Introspect(meter), server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            introspect_pb2.DESCRIPTOR.services_by_name["Introspect"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
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
    follower = (
        asyncio.create_task(_follow_readiness(health_servicer, names, ready), name="readiness")
        if ready is not None else None
    )
    try:
        yield server, bound
    finally:
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
        for name in ["", *names]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace_s)
        if sock is not None:
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()
        log.info("stopped %s", ", ".join(names))


READY_EVERY_S = 2.0
"""How often a server whose readiness depends on something else asks it."""


async def _follow_readiness(
    health_servicer: health.aio.HealthServicer,
    names: list[str],
    ready: Callable[[], Awaitable[bool]],
) -> None:
    """Sets gRPC health to what ready() says, logging each change, until cancelled."""
    serving = True
    while True:
        await asyncio.sleep(READY_EVERY_S)
        now = await ready()
        if now == serving:
            continue
        serving = now
        status = health_pb2.HealthCheckResponse
        for name in ["", *names]:
            await health_servicer.set(name, status.SERVING if now else status.NOT_SERVING)
        log.log(logging.INFO if now else logging.WARNING,
                "%s: %s", ", ".join(names), "serving again" if now else "not ready")


def open_channel(address: str, token: str = "") -> grpc.aio.Channel:
    """A channel to a service address (unix:PATH or HOST:PORT, or a comma-separated list of
    replicas, which take calls in turn) whose calls carry the service token (if given) and the
    grant of the call being served."""
    return grpc.aio.insecure_channel(
        channel_target(address),
        options=[*CHANNEL_OPTIONS, *balancing(address)],
        interceptors=[_CallMetadata(token)],
    )


async def health_state(channel: grpc.aio.Channel, timeout_s: float = 1.0, service: str = "") -> str:
    """What gRPC health says of the server behind channel: serving, not_serving or unreachable.

    Behind a list of replicas the check goes to one that is connected, so a service is
    unreachable only when none of its replicas is.
    """
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    except grpc.aio.AioRpcError:
        return "unreachable"
    return "serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "not_serving"


async def wait_serving(address: str, timeout_s: float = 30.0, service: str = "") -> None:
    """Waits until the service at address reports SERVING on gRPC health; for a list of
    replicas, until one of them does (the others are called once they connect)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with open_channel(address) as channel:
        while True:
            if await health_state(channel, service=service) == "serving":
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{address} did not report SERVING within {timeout_s}s")
            await asyncio.sleep(0.05)


# How a service waited for without an end stands, as its warnings say it.
_NOT_SERVING = {
    "unreachable": "does not answer",
    "not_serving": "answers but is not serving yet",
}
# The longest pause between two health checks of a service waited for without an end.
PATIENT_CHECK_MOST_S = 1.0


async def wait_serving_patiently(name: str, address: str, warn_every_s: float = 10.0) -> None:
    """Waits, however long it takes, until the service at address reports SERVING, with a
    warning line every warn_every_s while it does not: for a service this one cannot start
    without, where exiting would only be restarted into the same wait."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    warn_at, pause_s = start + warn_every_s, 0.05
    async with open_channel(address) as channel:
        while (state := await health_state(channel)) != "serving":
            if loop.time() >= warn_at:
                log.warning(
                    "the %s at %s %s (waited %.0f s; see its log); still waiting for it",
                    name, address, _NOT_SERVING.get(state, state), loop.time() - start,
                )
                warn_at = loop.time() + warn_every_s
            await asyncio.sleep(pause_s)
            pause_s = min(2 * pause_s, PATIENT_CHECK_MOST_S)


class ReadAtScrape(Collector):
    """Metric families a service builds from its own counters each time it is scraped."""

    def __init__(self, read: Callable[[], Iterable[Metric]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        """The families as they stand now."""
        return list(self._read())
