"""Search latency while vector indexes are being saved: the same searches and the same writes
against a store that saves its indexes every second and one that saves them only at exit."""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import numpy as np

from bench.compare import latency
from bench.owners import import_lines, model_id_of, text_of
from tests.support import running_stack

RESULTS = Path(__file__).resolve().parent / "results"
OWNER = "o000000"


async def post_import(http: aiohttp.ClientSession, base: str, body: bytes) -> None:
    async with http.post(f"{base}/api/v1/import", data=body) as reply:
        assert reply.status == 200, await reply.text()


def one_owner(body: bytes) -> bytes:
    """The same lines with every memory given to one owner (the one searched)."""
    lines = []
    for line in body.decode().splitlines():
        data = json.loads(line)
        data["memory"]["user_id"] = OWNER
        lines.append(json.dumps(data))
    return ("\n".join(lines) + "\n").encode()


async def measure(args: argparse.Namespace, save_every: str) -> dict[str, object]:
    """Seeds one owner, then searches it while another client keeps adding to it."""
    rng = np.random.default_rng(11)
    with (
        tempfile.TemporaryDirectory(prefix="saves-") as tmp,
        running_stack(
            Path(tmp) / "data",
            ["embedder", "store", "search", "gateway"],
            HYATLAS_MODE="lite",
            HYATLAS_STORE_SAVE_EVERY=save_every,
        ) as stack,
    ):
        base = stack.base_url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
            model_id = await model_id_of(http, base)
            for first in range(0, args.memories, 5000):
                count = min(5000, args.memories - first)
                await post_import(http, base, one_owner(import_lines(first, count, model_id, rng)))
            stop = asyncio.Event()

            async def keep_writing() -> int:
                written, first = 0, args.memories
                while not stop.is_set():
                    body = one_owner(import_lines(first, args.write_batch, model_id, rng))
                    await post_import(http, base, body)
                    first += args.write_batch
                    written += args.write_batch
                return written

            writer = asyncio.create_task(keep_writing())
            took = []
            for i in range(args.searches):
                body = {"query": text_of(i), "user_id": OWNER, "reader": "vector"}
                started = time.perf_counter()
                async with http.post(f"{base}/api/v1/search", json=body) as reply:
                    assert reply.status == 200, await reply.text()
                    await reply.read()
                took.append((time.perf_counter() - started) * 1000)
            stop.set()
            written = await writer
    return {"save_every": save_every, "written_meanwhile": written, "search_ms": latency(took)}


async def run(args: argparse.Namespace) -> dict[str, object]:
    saving = await measure(args, "1s")
    quiet = await measure(args, "off")
    p95 = saving["search_ms"]["p95"] / quiet["search_ms"]["p95"]  # type: ignore[index]
    return {
        "measured": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "memories": args.memories,
        "saving": saving,
        "not_saving": quiet,
        "p95_ratio": round(p95, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--memories", type=int, default=100_000, help="of the one owner searched")
    parser.add_argument("--searches", type=int, default=1_000)
    parser.add_argument("--write-batch", type=int, default=50, help="rows a write adds")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    report["machine"] = f"{platform.machine()}, load {Path('/proc/loadavg').read_text().split()[0]}"
    print(json.dumps(report, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "saves.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
