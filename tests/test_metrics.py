"""/metrics: Prometheus text with the gateway's requests and every backing service's gRPC calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support import Stack, running_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    data_dir: Path = tmp_path_factory.mktemp("metrics")
    # Lite, so the counts below are the test's own; the extractor and consolidator run for the
    # reflection test, though the gateway gathers only the services lite runs.
    with running_stack(data_dir, ["store", "search", "extractor", "consolidator", "gateway"],
                       HYATLAS_EMBEDDER_ADDR=embedder_address) as running:
        yield running


async def _call(stack: Stack, method: str, path: str, **kw: Any) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, stack.base_url + path, **kw) as reply,
    ):
        return reply.status, await reply.text()


async def _scrape(stack: Stack) -> list[Sample]:
    status, text = await _call(stack, "GET", "/metrics")
    assert status == 200, text
    families = list(text_string_to_metric_families(text))
    names = [family.name for family in families]
    assert len(names) == len(set(names)), "a metric family appears twice"
    return [sample for family in families for sample in family.samples]


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(found)


async def test_metrics_count_requests_by_route_and_status_and_each_services_calls(
    stack: Stack,
) -> None:
    before = await _scrape(stack)
    status, _ = await _call(stack, "POST", "/api/v1/add",
                            json={"text": "Metrics see this write", "user_id": "metrics"})
    assert status == 200
    status, _ = await _call(stack, "POST", "/api/v1/search",
                            json={"query": "which write", "user_id": "metrics"})
    assert status == 200
    status, _ = await _call(stack, "POST", "/api/v1/add", json={"text": ""})
    assert status == 400
    after = await _scrape(stack)

    def grew(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    add = {"route": "/api/v1/add", "method": "POST"}
    assert grew("hyatlas_http_requests_total", **add, status="200") == 1
    assert grew("hyatlas_http_requests_total", **add, status="400") == 1
    assert grew("hyatlas_http_request_seconds_count", **add) == 2
    assert grew("hyatlas_http_requests_total", route="/api/v1/search", status="200") == 1
    # The write went through the store (and the store embedded it); the search service ran once.
    assert grew("hyatlas_grpc_requests_total", service="store",
                method="/hyatlas.v1.Store/Apply", code="OK") == 1
    assert grew("hyatlas_grpc_requests_total", service="search",
                method="/hyatlas.v1.Search/SearchMemories", code="OK") == 1
    assert grew("hyatlas_grpc_requests_total", service="embedder") >= 2
    assert grew("hyatlas_grpc_request_seconds_count", service="store",
                method="/hyatlas.v1.Store/Apply") == 1
    assert _value(after, "hyatlas_grpc_requests_in_flight", service="store") == 0
    assert _value(after, "hyatlas_service_up", service="store") == 1
    # Each service's own figures: the embedder's batches; lite runs no extractor and no
    # consolidator, so none of theirs are gathered.
    assert grew("hyatlas_embedder_texts_total", service="embedder") >= 2
    assert grew("hyatlas_embedder_runs_total", service="embedder") >= 1
    assert _value(after, "hyatlas_embedder_queue_calls", service="embedder") == 0
    assert not {s.labels.get("service") for s in after} & {"extractor", "consolidator"}


async def test_ultra_gathers_the_extractors_and_the_consolidators_figures(
    tmp_path: Path, embedder_address: str
) -> None:
    with running_stack(tmp_path, ["store", "search", "extractor", "consolidator", "gateway"],
                       HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_MODE="ultra") as ultra:
        samples = await _scrape(ultra)
    names = {s.name for s in samples}
    assert {"hyatlas_extractions_total", "hyatlas_extraction_refused_forgotten_total",
            "hyatlas_consolidation_passes_total", "hyatlas_consolidation_running"} <= names
    assert _value(samples, "hyatlas_extractions_total", service="extractor",
                  outcome="extracted") == 0
    assert _value(samples, "hyatlas_service_up", service="consolidator") == 1


async def test_a_service_that_does_not_answer_is_reported_down(
    tmp_path: Path, embedder_address: str
) -> None:
    # Ultra needs the consolidator, which this stack does not run.
    with running_stack(tmp_path, ["store", "search", "gateway"],
                       HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_MODE="ultra") as partial:
        samples = await _scrape(partial)
    assert _value(samples, "hyatlas_service_up", service="store") == 1
    assert _value(samples, "hyatlas_service_up", service="consolidator") == 0
    assert not any(s.labels.get("service") == "consolidator" and s.name != "hyatlas_service_up"
                   for s in samples)


async def test_a_failed_call_is_counted_under_its_status_code(stack: Stack) -> None:
    before = await _scrape(stack)
    status, _ = await _call(stack, "POST", "/api/v1/history",
                            json={"id": "no-such-memory", "user_id": "metrics"})
    assert status == 404
    after = await _scrape(stack)
    labels = {"service": "store", "method": "/hyatlas.v1.Store/GetHistory", "code": "NOT_FOUND"}
    assert (_value(after, "hyatlas_grpc_requests_total", **labels)
            - _value(before, "hyatlas_grpc_requests_total", **labels)) == 1
    assert _value(after, "hyatlas_http_requests_total", route="/api/v1/history",
                  status="404") >= 1


async def test_paths_no_route_takes_share_one_series(stack: Stack) -> None:
    for path in ("/nothing-here", "/wp-admin/setup.php", "/x/y/z"):
        status, _ = await _call(stack, "GET", path)
        assert status == 404
    samples = await _scrape(stack)
    assert _value(samples, "hyatlas_http_requests_total", route="(unmatched)", status="404") >= 3
    assert not any("wp-admin" in s.labels.get("route", "") for s in samples)


def test_a_plain_grpc_client_finds_each_service_by_reflection_and_reads_its_metrics(
    stack: Stack,
) -> None:
    """What grpcurl does: list services by reflection, then call one from its descriptor."""
    import grpc
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    for service in ("store", "search", "embedder", "extractor", "consolidator"):
        with grpc.insecure_channel(stack.address(service)) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            names = set(database.get_services())
            assert {"grpc.health.v1.Health", "hyatlas.v1.Introspect"} <= names, service
            pool = descriptor_pool.DescriptorPool(database)
            method = pool.FindServiceByName("hyatlas.v1.Introspect").FindMethodByName(
                "GetMetrics")
            request = message_factory.GetMessageClass(method.input_type)()
            reply_class = message_factory.GetMessageClass(method.output_type)
            call = channel.unary_unary(
                "/hyatlas.v1.Introspect/GetMetrics",
                request_serializer=lambda message: message.SerializeToString(),
                response_deserializer=reply_class.FromString,
            )
            text = call(request, timeout=10).text
        assert "# TYPE hyatlas_grpc_request_seconds histogram" in text, service


async def test_an_import_embeds_each_batch_once_while_the_one_before_is_written(
    stack: Stack,
) -> None:
    lines = [json.dumps({"format": "hyatlas-export", "version": 1})] + [
        json.dumps({"type": "memory", "memory": {"user_id": "bulk", "content": text}})
        for text in [f"Turn {i} of the talk" for i in range(600)]
    ]
    before = await _scrape(stack)
    status, text = await _call(stack, "POST", "/api/v1/import", data="\n".join(lines) + "\n",
                               headers={"Content-Type": "application/x-ndjson"})
    assert status == 200, text
    assert json.loads(text)["imported"] == 600
    after = await _scrape(stack)

    def grew(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    # Two batches (500 lines and 100): each embedded ahead by EmbedImport, then written by
    # ImportRows with those vectors, so every text went through the model once.
    for method in ("EmbedImport", "ImportRows"):
        assert grew("hyatlas_grpc_requests_total", service="store",
                    method=f"/hyatlas.v1.Store/{method}", code="OK") == 2
    assert grew("hyatlas_embedder_texts_total", service="embedder") == 600
    status, text = await _call(stack, "GET", "/api/v1/list",
                               params={"user_id": "bulk", "limit": "1000", "include_raw": "true"})
    listed = json.loads(text)["memories"]
    # Written in the file's order: the newest first.
    assert [m["content"] for m in listed] == [f"Turn {i} of the talk" for i in reversed(range(600))]


async def test_an_import_sent_again_runs_the_model_on_none_of_the_lines_it_wrote(
    stack: Stack,
) -> None:
    # Until 2026-12-08 every line without a vector was embedded again before the store
    # skipped the ids it held: a resent file of 1,000 lines took longer than its first import.
    lines = [
        json.dumps({"type": "memory", "memory": {"user_id": "resend", "content": text}})
        for text in [f"Line {i} sent twice" for i in range(30)]
    ]

    async def texts_embedded(body: list[str], imported: int, skipped: int) -> float:
        before = await _scrape(stack)
        status, text = await _call(stack, "POST", "/api/v1/import", data="\n".join(body) + "\n")
        assert status == 200, text
        assert (json.loads(text)["imported"], json.loads(text)["skipped"]) == (imported, skipped)
        after = await _scrape(stack)
        name = "hyatlas_embedder_texts_total"
        return _value(after, name, service="embedder") - _value(before, name, service="embedder")

    assert await texts_embedded(lines, 30, 0) == 30
    assert await texts_embedded(lines, 0, 30) == 0
    added = json.dumps({"type": "memory", "memory": {"user_id": "resend", "content": "One more"}})
    assert await texts_embedded([*lines, added], 1, 30) == 1
