"""Prometheus metrics at /metrics: the gateway's own requests, and every backing service's.

Each gRPC service keeps its own registry (shared.rpc) and hands it over on Introspect.GetMetrics
through the channel the gateway already has, so no service opens a port of its own; here each
service's samples get a `service` label and are served together with the gateway's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator

import grpc
import prometheus_client
from aiohttp import web
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gateway.errors import Handler
from gateway.state import CHANNELS
from shared.grants import check_everyone
from shared.pb import introspect_pb2, introspect_pb2_grpc
from shared.rpc import LATENCY_BUCKETS_S

SCRAPE_TIMEOUT_S = 2.0
UNMATCHED = "(unmatched)"
"""The route label of a request no route took (so a scan of random paths adds one series)."""


class GatewayMetrics:
    """The gateway's own series: requests by route, method and status; their latency."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "hyatlas_http_requests", "HTTP requests answered, by route, method and status",
            ["route", "method", "status"], registry=self.registry)
        self.latency = prometheus_client.Histogram(
            "hyatlas_http_request_seconds", "Time to answer an HTTP request, by route and method",
            ["route", "method"], buckets=LATENCY_BUCKETS_S, registry=self.registry)


METRICS = web.AppKey("metrics", GatewayMetrics)


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Counts and times every request, with the status the client finally got."""
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        metrics = request.app[METRICS]
        route = _route(request)
        metrics.requests.labels(route, request.method, str(status)).inc()
        metrics.latency.labels(route, request.method).observe(time.perf_counter() - started)


async def _service_text(channel: grpc.aio.Channel) -> str | None:
    """A service's own metrics, or None when it does not answer."""
    try:
        reply = await introspect_pb2_grpc.IntrospectStub(channel).GetMetrics(
            introspect_pb2.GetMetricsRequest(), timeout=SCRAPE_TIMEOUT_S
        )
    except grpc.aio.AioRpcError:
        return None
    return reply.text


class _Scraped(Collector):
    """The services' families, one per name, each sample labelled with its service."""

    def __init__(self, texts: dict[str, str | None]) -> None:
        self._texts = texts

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily(
            "hyatlas_service_up", "Whether the service answered this scrape", labels=["service"])
        merged: dict[str, Metric] = {}
        for service, text in self._texts.items():
            up.add_metric([service], 0.0 if text is None else 1.0)
            for family in text_string_to_metric_families(text or ""):
                into = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type))
                into.samples.extend(
                    sample._replace(labels={"service": service, **sample.labels})
                    for sample in family.samples
                )
        yield up
        yield from merged.values()


def _exposition(app: web.Application, texts: dict[str, str | None]) -> Iterator[bytes]:
    yield prometheus_client.generate_latest(app[METRICS].registry)
    scraped = prometheus_client.CollectorRegistry()
    scraped.register(_Scraped(texts))
    yield prometheus_client.generate_latest(scraped)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text: the gateway's requests and every backing service's gRPC calls, counted
    over every owner, so for a token reaching every owner."""
    check_everyone("the server's metrics")
    channels = request.app[CHANNELS]
    texts = await asyncio.gather(*(_service_text(channel) for channel in channels.values()))
    body = b"".join(_exposition(request.app, dict(zip(channels, texts, strict=True))))
    return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


def register(app: web.Application) -> None:
    """Adds the metrics store and the /metrics route (the middleware is added by make_app)."""
    app[METRICS] = GatewayMetrics()
    app.router.add_get("/metrics", metrics)
