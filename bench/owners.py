"""The store's resident memory with many owners: N owners of one memory each, imported with
their vectors, then searched one owner after another so every owner's index is loaded once,
against the index cache budget (HYATLAS_INDEX_CACHE_MB)."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import numpy as np

from bench.compare import latency, memory_of
from bench.seeding import b64
from shared.settings import Settings
from tests.support import running_stack

RESULTS = Path(__file__).resolve().parent / "results"
NDIM = 384
WORDS = (
    "river", "garden", "violin", "bakery", "harbour", "lantern", "meadow", "pottery", "comet",
    "orchard",
)


def text_of(index: int) -> str:
    """A short memory (no sentence keys), different for every owner."""
    rng = random.Random(index)
    return f"note {index}: the {rng.choice(WORDS)} by the {rng.choice(WORDS)} on day {index % 365}"


def import_lines(first: int, count: int, model_id: str, rng: np.random.Generator) -> bytes:
    """Import lines of owners first..first+count, one memory each, with random unit vectors."""
    vectors = rng.standard_normal((count, NDIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    lines = []
    for offset, vector in enumerate(vectors):
        index = first + offset
        memory = {"id": f"m{index}", "user_id": f"o{index:06d}", "content": text_of(index)}
        line = {"type": "memory", "memory": memory, "vector": b64(vector), "model_id": model_id}
        lines.append(json.dumps(line))
    return ("\n".join(lines) + "\n").encode()


async def model_id_of(http: aiohttp.ClientSession, base: str) -> str:
    """The embedder's model id, from one memory written and exported."""
    async with http.post(f"{base}/api/v1/add", json={"text": "probe", "user_id": "probe"}) as r:
        assert r.status == 200, await r.text()
    async with http.get(f"{base}/api/v1/export", params={"user_id": "probe"}) as r:
        body = await r.text()
    for line in body.splitlines():
        data = json.loads(line)
        if data.get("type") == "memory":
            return str(data["model_id"])
    raise RuntimeError("the probe memory was not exported")


async def search_owners(
    http: aiohttp.ClientSession, base: str, owners: list[int], store_pid: int
) -> tuple[list[float], list[dict[str, float]]]:
    """Vector searches, one owner after another; latencies and the store's memory as it goes."""
    took: list[float] = []
    samples = []
    for n, index in enumerate(owners, 1):
        body = {"query": text_of(index), "user_id": f"o{index:06d}", "reader": "vector"}
        started = time.perf_counter()
        async with http.post(f"{base}/api/v1/search", json=body) as reply:
            assert reply.status == 200, await reply.text()
            await reply.read()
        took.append((time.perf_counter() - started) * 1000)
        if n % max(1, len(owners) // 10) == 0:
            samples.append({"searched": n, **memory_of(store_pid)})
    return took, samples


async def run(args: argparse.Namespace) -> dict[str, object]:
    rng = np.random.default_rng(7)
    with (
        tempfile.TemporaryDirectory(prefix="owners-") as tmp,
        running_stack(
            Path(tmp) / "data",
            ["embedder", "store", "search", "gateway"],
            HYATLAS_MODE="lite",
            HYATLAS_INDEX_CACHE_MB=str(args.cache_mb),
            # The embedder's queue as `make run` has it (base_env widens it for tests).
            HYATLAS_EMBED_MAX_QUEUE=str(Settings.embed_max_queue),
        ) as stack,
    ):
        store = stack.procs["store"].proc
        assert store is not None
        base, store_pid = stack.base_url, store.pid
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            model_id = await model_id_of(http, base)
            at_start = memory_of(store_pid)
            started = time.perf_counter()
            for first in range(0, args.owners, args.batch):
                count = min(args.batch, args.owners - first)
                body = import_lines(first, count, model_id, rng)
                async with http.post(f"{base}/api/v1/import", data=body) as reply:
                    assert reply.status == 200, await reply.text()
                print(f"imported {first + count} owners", flush=True)
            import_s = time.perf_counter() - started
            after_import = memory_of(store_pid)
            touched = random.Random(3).sample(range(args.owners), args.searches)
            took, samples = await search_owners(http, base, touched, store_pid)
    return {
        "measured": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, load {' '.join(f'{x:.1f}' for x in _load())}",
        "owners": args.owners,
        "cache_mb": args.cache_mb,
        "import_rows_per_s": round(args.owners / import_s, 1),
        "store_mib": {"start": at_start, "after_import": after_import, "while_searching": samples},
        "search_ms": latency(took),
    }


def _load() -> tuple[float, ...]:
    return tuple(float(x) for x in Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--owners", type=int, default=100_000)
    parser.add_argument("--searches", type=int, default=5_000, help="owners searched, each once")
    parser.add_argument("--cache-mb", type=int, default=64, help="HYATLAS_INDEX_CACHE_MB")
    parser.add_argument("--batch", type=int, default=5_000, help="import lines a request")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "owners.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
