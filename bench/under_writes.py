"""Search latency while other clients write: the same hybrid searches through REST, first on a
quiet stack, then while `--writers` clients keep adding memories one at a time (each embedded by
the model, as an agent's turns are), to the owner searched.

A lite stack on a temp dir is seeded with the compare bench's memories of one owner (its seeder:
no model run per memory). Prints a table and writes bench/results/under_writes.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from bench.compare import Ours, latency, make_seeder, memory_parts, memory_text, seed
from bench.hops import commit
from bench.locomo_retrieval import DEFAULT_DATA, load
from bench.postgres import add_backend_argument, results_file, throwaway
from tests.support import running_stack

RESULTS = Path(__file__).resolve().parent / "results"
OWNER = "bench"
WARM_UP = 20


async def searches(ours: Ours, asked: list[str]) -> list[float]:
    """Each question asked once, in turn (hybrid reader): the milliseconds each took."""
    return [(await ours.search(text, OWNER, "hybrid"))[0] for text in asked]


async def while_writing(ours: Ours, asked: list[str], texts: list[str], writers: int) -> Any:
    """The searches while `writers` clients add texts one at a time; their times, and the
    adds a second made meanwhile."""
    work = iter(texts)
    stop, under_way = asyncio.Event(), asyncio.Event()
    added = 0

    async def writer() -> None:
        nonlocal added
        for text in work:
            if stop.is_set():
                return
            await ours.add(text, OWNER)
            added += 1
            if added >= writers:
                under_way.set()

    tasks = [asyncio.create_task(writer()) for _ in range(writers)]
    await under_way.wait()  # as many adds made as there are writers before the first search
    started, before = time.perf_counter(), added
    took = await searches(ours, asked)
    rate = (added - before) / (time.perf_counter() - started)
    stop.set()
    await asyncio.gather(*tasks)
    if not next(work, None):
        raise RuntimeError("the writers ran out of texts before the searches ended")
    return took, rate


async def measure(args: argparse.Namespace, base_url: str) -> dict[str, object]:
    turns_by_owner, questions = load(args.data)
    turns = [t.text for rows in turns_by_owner.values() for t in rows]
    parts = memory_parts(turns, args.memories + args.to_write)
    texts = [memory_text(turns, part) for part in parts]
    seeder = await make_seeder((turns, parts), None, args.threads)
    assert seeder is not None
    asked = [q.text for q in questions[:: max(1, len(questions) // args.questions)]]
    asked = asked[: args.questions]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        ours = Ours(http, base_url)
        await seed(ours, None, seeder, texts, [OWNER] * len(texts), 0, args.memories)
        await searches(ours, asked[:WARM_UP])
        quiet = await searches(ours, asked)
        busy, rate = await while_writing(ours, asked, texts[args.memories :], args.writers)
    return {
        "quiet_ms": latency(quiet),
        "while_writing_ms": latency(busy),
        "adds_per_s_meanwhile": round(rate, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="locomo-dev.json")
    parser.add_argument("--memories", type=int, default=10_000, help="seeded, of the one owner")
    parser.add_argument("--writers", type=int, default=4, help="clients adding meanwhile")
    parser.add_argument("--to-write", type=int, default=20_000, help="texts the writers may add")
    parser.add_argument("--questions", type=int, default=300, help="LoCoMo questions asked")
    parser.add_argument("--threads", type=int, default=2, help="the model's threads")
    add_backend_argument(parser)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default bench/results/under_writes.json (under_writes_postgres.json on PostgreSQL)",
    )
    args = parser.parse_args()
    started = datetime.now(UTC)
    load_start = os.getloadavg()
    with (
        tempfile.TemporaryDirectory(prefix="under-writes-") as tmp,
        throwaway(args.backend, Path(tmp) / "postgres") as databases,
        running_stack(
            Path(tmp) / "data",
            ["embedder", "store", "search", "gateway"],
            HYATLAS_MODE="lite",
            HYATLAS_EMBED_THREADS=str(args.threads),
            **({"HYATLAS_STORE_DSN": databases.new_dsn()} if databases else {}),
        ) as stack,
    ):
        result = asyncio.run(measure(args, stack.base_url))
    report = {
        "started": started.isoformat(timespec="seconds"),
        "commit": commit(),
        "backend": args.backend,
        "memories": args.memories,
        "writers": args.writers,
        "questions": args.questions,
        "load_avg_start": [round(x, 2) for x in load_start],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        **result,
    }
    out = args.out or results_file(RESULTS, "under_writes", args.backend)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{args.memories:,} memories, one owner, {args.questions} hybrid searches; "
          f"{args.writers} writers added {result['adds_per_s_meanwhile']} a second meanwhile\n")
    print("| searches | p50 ms | p95 ms | p99 ms | max ms |\n|---|---|---|---|---|")
    for name in ("quiet_ms", "while_writing_ms"):
        figures: Any = result[name]
        label = "alone" if name == "quiet_ms" else f"while {args.writers} clients add"
        print(f"| {label} | {figures['p50']} | {figures['p95']} | {figures['p99']} | "
              f"{figures['max']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
