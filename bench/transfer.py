"""Bulk import speed: minimal lines (embedded) and a full export (vectors reused), against the
embedder's own batched throughput measured in the same run."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.embedder import sentences
from shared.clients import EmbedderClient
from shared.rpc import open_channel
from shared.settings import Settings
from tests.support import running_stack

RESULTS = Path(__file__).resolve().parent / "results"
# As many texts a call as the gateway sends the store in one import batch.
BATCH = 500


async def embed_s(client: EmbedderClient, texts: list[str]) -> float:
    """How long the embedder service takes for texts, called with one batch at a time."""
    start = time.perf_counter()
    for i in range(0, len(texts), BATCH):
        await client.embed(texts[i : i + BATCH])
    return time.perf_counter() - start


def jsonl(texts: list[str], first: int) -> bytes:
    """Minimal memory lines of ten owners."""
    return "".join(
        json.dumps({"type": "memory", "memory": {"user_id": f"u{(first + i) % 10}", "content": t}})
        + "\n"
        for i, t in enumerate(texts)
    ).encode()


async def post_import(base_url: str, body: bytes) -> tuple[dict[str, object], float]:
    """The import's reply and how long it took."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        start = time.perf_counter()
        async with session.post(base_url + "/api/v1/import", data=body) as reply:
            result = await reply.json()
            assert reply.status == 200, result
        return result, time.perf_counter() - start


async def export(base_url: str) -> bytes:
    """The whole store as JSONL."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session,
        session.get(base_url + "/api/v1/export") as reply,
    ):
        assert reply.status == 200
        return await reply.read()


async def run(count: int) -> dict[str, object]:
    """Embedder time and bare import time in alternating rounds (a busy machine's load changes
    by the minute, so both see the same), then a full export imported into a fresh store."""
    texts = sentences(count)
    embed_total = bare_total = 0.0
    imported = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # The embedder's queue as `make run` has it (base_env widens it for tests).
        queue = {"HYATLAS_EMBED_MAX_QUEUE": str(Settings.embed_max_queue)}
        with running_stack(root / "embedder", ["embedder"], **queue) as embedder_stack:
            address = embedder_stack.address("embedder")
            env = {"HYATLAS_EMBEDDER_ADDR": address, "HYATLAS_ADMIN": "on"}
            with running_stack(root / "a", ["store", "gateway"], **env) as first:
                async with open_channel(address) as channel:
                    client = EmbedderClient(channel, timeout_s=600)
                    await client.embed(texts[:BATCH])  # warm up
                    for i in range(0, count, BATCH):
                        chunk = texts[i : i + BATCH]
                        embed_total += await embed_s(client, chunk)
                        reply, took_s = await post_import(first.base_url, jsonl(chunk, i))
                        bare_total += took_s
                        imported += int(reply["imported"])  # type: ignore[call-overload]
                dump = await export(first.base_url)
            with running_stack(root / "b", ["store", "gateway"], **env) as second:
                full, full_s = await post_import(second.base_url, dump)
    # The vectors the bare import made: each row's own, plus its clause keys'. The stack pools
    # a row's clause vectors from its own model run (HYATLAS_EMBED_POOLED_SPANS on), so a row is
    # one model input, as each text is to the embedder alone.
    vectors = imported + dump.count(b'"kind": "clause"')
    return {
        "machine": platform.machine(),
        "rows": count,
        "embedder_texts_per_s": round(count / embed_total, 1),
        "import_without_vectors": {
            "rows_per_s": round(imported / bare_total, 1),
            "vectors_per_s": round(vectors / bare_total, 1),
            "ratio_to_embedder": round(imported / bare_total / (count / embed_total), 3),
        },
        "import_with_vectors": {
            "rows_per_s": round(int(full["imported"]) / full_s, 1),  # type: ignore[call-overload]
        },
    }


def main() -> int:
    """Runs the benchmark, prints it and writes bench/results/transfer.json."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=3000)
    args = parser.parse_args()
    result = asyncio.run(run(args.rows))
    print(json.dumps(result, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "transfer.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
