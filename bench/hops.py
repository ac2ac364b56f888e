"""Where one search's time goes, hop by hop: each call a search makes, timed on its own.

A lite stack (embedder, store, search, gateway) on a temp dir is seeded with the compare bench's
memories of one owner (its seeder: no model run per memory). Then every question is asked, in
turn, of: the model in this process (the floor), a bare gRPC round trip (DescribeModel), a bare
REST round trip (/healthz), the embedder's Embed, the store's VectorSearch and KeywordSearch as
the full ranking asks them, the search service for the vector and hybrid readers, and REST for
both. One call at a time, so each figure is that step alone. Prints a table, and the least a
vector search through REST could take in this layout (its Embed plus the other round trips), and
writes bench/results/hops.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from bench.compare import K, Ours, latency, make_seeder, memory_parts, memory_text, seed
from bench.locomo_retrieval import DEFAULT_DATA, load
from services.embedder.models import find_model_files
from services.embedder.onnx_encoder import OnnxEncoder
from services.search.engine import FULL_POOL
from shared.pb import (
    common_pb2,
    embedder_pb2,
    embedder_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)
from shared.rpc import open_channel
from tests.support import Stack, running_stack

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "hops.json"
OWNER = "bench"
WARM_UP = 20
MODEL = "model in this process (to_thread)"
GRPC_TRIP = "gRPC round trip (DescribeModel)"
REST_TRIP = "REST round trip (GET /healthz)"
EMBED = "Embedder.Embed, the query"
Step = Callable[[str], Awaitable[Any]]


def embedded(embedder: embedder_pb2_grpc.EmbedderStub, text: str) -> Awaitable[Any]:
    """The embedder's Embed of one query."""
    return embedder.Embed(embedder_pb2.EmbedRequest(texts=[text], is_query=True))


@dataclass
class Callers:
    """What the steps call: the REST client, each service's stub, the model in this process."""

    ours: Ours
    embedder: embedder_pb2_grpc.EmbedderStub
    store: store_pb2_grpc.StoreStub
    search: search_pb2_grpc.SearchStub
    encoder: OnnxEncoder


def steps(callers: Callers, vectors: dict[str, Any]) -> dict[str, Step]:
    """Each call of a search, by name, as a function of the question (vectors: each question's
    Embed reply, for the store's vector search)."""
    ours, embedder, store, search = callers.ours, callers.embedder, callers.store, callers.search
    encoder = callers.encoder
    scope = common_pb2.Scope(user_id=OWNER)

    async def vector_search(text: str) -> Any:
        embedded = vectors[text]
        request = store_pb2.VectorSearchRequest(
            scope=scope, vector=embedded.vectors[0].values, model_id=embedded.model_id,
            k=FULL_POOL, distinct_text=True,
        )
        return await store.VectorSearch(request)

    def searching(reader: str) -> Step:
        async def step(text: str) -> Any:
            request = search_pb2.SearchMemoriesRequest(
                scope=scope, query=text, limit=K, reader=reader
            )
            return await search.SearchMemories(request)

        return step

    def rest(reader: str) -> Step:
        async def step(text: str) -> Any:
            return await ours.search(text, OWNER, reader)

        return step

    async def model(text: str) -> Any:
        return await asyncio.to_thread(encoder.encode, [text])

    async def keyword_search(text: str) -> Any:
        request = store_pb2.KeywordSearchRequest(
            scope=scope, query=text, k=FULL_POOL, min_terms=1, context_keys=True,
            distinct_text=True,
        )
        return await store.KeywordSearch(request)

    async def round_trip(text: str) -> Any:
        return await embedder.DescribeModel(embedder_pb2.DescribeModelRequest())

    async def rest_round_trip(text: str) -> Any:
        async with ours.http.get(f"{ours.base}/healthz") as reply:
            return await reply.read()

    async def embed(text: str) -> Any:
        return await embedded(embedder, text)

    return {
        MODEL: model,
        GRPC_TRIP: round_trip,
        REST_TRIP: rest_round_trip,
        EMBED: embed,
        f"Store.VectorSearch, k {FULL_POOL}": vector_search,
        f"Store.KeywordSearch, k {FULL_POOL}, relaxed, context keys": keyword_search,
        "Search.SearchMemories, vector": searching("vector"),
        "Search.SearchMemories, hybrid": searching("hybrid"),
        "REST /api/v1/search, vector": rest("vector"),
        "REST /api/v1/search, hybrid": rest("hybrid"),
    }


async def timed(step: Step, text: str) -> float:
    """The step's milliseconds."""
    started = time.perf_counter()
    await step(text)
    return (time.perf_counter() - started) * 1000.0


async def measure(args: argparse.Namespace, stack: Stack) -> dict[str, dict[str, float]]:
    turns_by_owner, questions = load(args.data)
    turns = [t.text for rows in turns_by_owner.values() for t in rows]
    parts = memory_parts(turns, args.memories)
    texts = [memory_text(turns, part) for part in parts]
    seeder = await make_seeder((turns, parts), None, args.threads)
    assert seeder is not None
    encoder = OnnxEncoder(find_model_files(None), args.threads)
    asked = [q.text for q in questions[:: max(1, len(questions) // args.questions)]]
    asked = asked[: args.questions]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        ours = Ours(http, stack.base_url)
        await seed(ours, None, seeder, texts, [OWNER] * len(texts), 0, len(texts))
        async with (
            open_channel(stack.address("embedder")) as to_embedder,
            open_channel(stack.address("store")) as to_store,
            open_channel(stack.address("search")) as to_search,
        ):
            callers = Callers(
                ours,
                embedder_pb2_grpc.EmbedderStub(to_embedder),
                store_pb2_grpc.StoreStub(to_store),
                search_pb2_grpc.SearchStub(to_search),
                encoder,
            )
            return await timings(callers, asked)


async def timings(callers: Callers, asked: list[str]) -> dict[str, dict[str, float]]:
    """Every step for every question in turn, after a warm-up."""
    vectors = {text: await embedded(callers.embedder, text) for text in asked}
    named = steps(callers, vectors)
    for text in asked[:WARM_UP]:
        for step in named.values():
            await step(text)
    times: dict[str, list[float]] = {name: [] for name in named}
    for text in asked:
        for name, step in named.items():
            times[name].append(await timed(step, text))
    return {name: latency(values) for name, values in times.items()}


def transport_floor(result: dict[str, dict[str, float]]) -> float:
    """The least a vector search through REST can take in this layout, by p50s: the query's
    Embed (the model and its round trip), the other two gRPC round trips it makes (gateway to
    search, search to store) and one REST round trip; the rest of its time is the work the
    store, the search service and the gateway do."""
    p50 = {name: figures["p50"] for name, figures in result.items()}
    return round(p50[EMBED] + 2 * p50[GRPC_TRIP] + p50[REST_TRIP], 2)


def commit() -> str:
    found = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return found.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="locomo-dev.json")
    parser.add_argument("--memories", type=int, default=10_000, help="memories of the one owner")
    parser.add_argument("--questions", type=int, default=200, help="LoCoMo questions asked")
    parser.add_argument("--threads", type=int, default=2, help="the model's threads, both sides")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = datetime.now(UTC)
    load_start = os.getloadavg()
    with (
        tempfile.TemporaryDirectory(prefix="hops-") as tmp,
        running_stack(
            Path(tmp) / "data",
            ["embedder", "store", "search", "gateway"],
            HYATLAS_EMBED_THREADS=str(args.threads),
        ) as stack,
    ):
        result = asyncio.run(measure(args, stack))
    report = {
        "started": started.isoformat(timespec="seconds"),
        "commit": commit(),
        "memories": args.memories,
        "questions": args.questions,
        "threads": args.threads,
        "load_avg_start": [round(x, 2) for x in load_start],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "latency_ms": result,
        "vector_transport_floor_ms": transport_floor(result),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{args.memories:,} memories, one owner, {args.questions} questions, "
          f"load {report['load_avg_start'][0]} -> {report['load_avg_end'][0]}\n")
    print("| step | p50 ms | p95 ms |\n|---|---|---|")
    for name, figures in result.items():
        print(f"| {name} | {figures['p50']} | {figures['p95']} |")
    print(f"\nThe vector reader's floor in this layout (the query's Embed, two more gRPC round "
          f"trips and one REST round trip, p50): {report['vector_transport_floor_ms']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
