"""LoCoMo turn-level retrieval through the REST API, in lite mode: recall, NDCG and latency."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from tests.support import running_stack

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "locomo" / "locomo-dev.json"
RESULTS = ROOT / "bench" / "results"
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
KS = (5, 10)


@dataclass
class Turn:
    dia_id: str
    text: str
    event_at: float


@dataclass
class Question:
    owner: str
    text: str
    category: int
    evidence: set[str]


@dataclass
class Scores:
    """Running sums of the per-question metrics of one group of questions."""

    n: int = 0
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, ranked: list[str], evidence: set[str]) -> None:
        self.n += 1
        for k in KS:
            found = evidence & set(ranked[:k])
            self._inc(f"recall_any@{k}", 1.0 if found else 0.0)
            self._inc(f"recall_all@{k}", 1.0 if found == evidence else 0.0)
            self._inc(f"evidence_frac@{k}", len(found) / len(evidence))
        dcg = sum(1 / math.log2(i + 2) for i, d in enumerate(ranked[:10]) if d in evidence)
        ideal = sum(1 / math.log2(i + 2) for i in range(min(len(evidence), 10)))
        self._inc("ndcg@10", dcg / ideal)

    def _inc(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value

    def means(self) -> dict[str, float]:
        return {k: round(v / self.n, 4) for k, v in self.sums.items()} | {"n": self.n}


def session_time(text: str) -> float:
    """Unix seconds of a LoCoMo session stamp such as '1:56 pm on 8 May, 2023' (read as UTC)."""
    when = datetime.strptime(text.strip(), "%I:%M %p on %d %B, %Y")
    return when.replace(tzinfo=UTC).timestamp()


def load(path: Path) -> tuple[dict[str, list[Turn]], list[Question]]:
    """Turns per conversation and the answerable questions of categories 1-4."""
    data = json.loads(path.read_text())
    turns: dict[str, list[Turn]] = {}
    questions: list[Question] = []
    for conv in data:
        owner = conv["sample_id"]
        c = conv["conversation"]
        rows: list[Turn] = []
        n = 1
        while f"session_{n}" in c:
            at = session_time(c[f"session_{n}_date_time"])
            for turn in c[f"session_{n}"]:
                rows.append(Turn(turn["dia_id"], f"{turn['speaker']}: {turn['text']}", at))
            n += 1
        turns[owner] = rows
        known = {t.dia_id for t in rows}
        for qa in conv["qa"]:
            if qa.get("category") not in CATEGORIES:
                continue
            evidence = {e for e in qa.get("evidence", []) if e in known}
            if evidence:
                questions.append(Question(owner, qa["question"], qa["category"], evidence))
    return turns, questions


async def ingest(
    http: aiohttp.ClientSession, base: str, turns: dict[str, list[Turn]], concurrency: int
) -> dict[str, str]:
    """Writes every turn as one memory; returns memory id -> dia_id."""
    ids: dict[str, str] = {}
    gate = asyncio.Semaphore(concurrency)

    async def add(owner: str, turn: Turn) -> None:
        async with gate:
            body = {
                "text": turn.text,
                "user_id": owner,
                "agent_id": "locomo",
                "event_at": turn.event_at,
                "metadata": {"dia_id": turn.dia_id},
            }
            async with http.post(f"{base}/api/v1/add", json=body) as reply:
                data = await reply.json()
                if reply.status != 200:
                    raise RuntimeError(f"add failed: {reply.status} {data}")
                ids[data["memory_id"]] = f"{owner}/{turn.dia_id}"

    await asyncio.gather(*(add(o, t) for o, rows in turns.items() for t in rows))
    return ids


async def ask(
    http: aiohttp.ClientSession,
    base: str,
    questions: list[Question],
    ids: dict[str, str],
    reader: str,
    min_score: float | None,
) -> dict[str, object]:
    """Asks every question with one reader; returns the metric table and latencies."""
    groups = {name: Scores() for name in [*CATEGORIES.values(), "overall"]}
    latencies: list[float] = []
    for q in questions:
        body: dict[str, object] = {
            "query": q.text,
            "user_id": q.owner,
            "agent_id": "locomo",
            "limit": 10,
            "reader": reader,
        }
        if min_score is not None:
            body["min_score"] = min_score
        started = time.perf_counter()
        async with http.post(f"{base}/api/v1/search", json=body) as reply:
            data = await reply.json()
        latencies.append((time.perf_counter() - started) * 1000)
        if reply.status != 200:
            raise RuntimeError(f"search failed: {reply.status} {data}")
        ranked = [
            ids.get(item["memory_id"], "")
            for channel in data["order"]
            if channel != "now"
            for item in data["memories"].get(channel, [])
        ]
        evidence = {f"{q.owner}/{e}" for e in q.evidence}
        for name in (CATEGORIES[q.category], "overall"):
            groups[name].add(ranked, evidence)
    latencies.sort()
    return {
        "metrics": {name: s.means() for name, s in groups.items()},
        "latency_ms": {
            "p50": round(statistics.median(latencies), 2),
            "p95": round(latencies[int(0.95 * (len(latencies) - 1))], 2),
        },
    }


def print_table(reader: str, result: dict[str, object]) -> None:
    metrics = result["metrics"]
    assert isinstance(metrics, dict)
    cols = [
        "recall_any@5",
        "recall_any@10",
        "recall_all@5",
        "recall_all@10",
        "evidence_frac@10",
        "ndcg@10",
    ]
    print(f"\nreader={reader}  latency {result['latency_ms']}")
    print(f"{'group':<12} {'n':>4} " + " ".join(f"{c:>16}" for c in cols))
    for name, m in metrics.items():
        print(f"{name:<12} {m['n']:>4} " + " ".join(f"{m[c]:>16.3f}" for c in cols))


async def run(args: argparse.Namespace) -> dict[str, object]:
    turns, questions = load(args.data)
    print(f"{sum(map(len, turns.values()))} turns, {len(questions)} questions", flush=True)
    with (
        tempfile.TemporaryDirectory(prefix="locomo-") as tmp,
        running_stack(
            Path(tmp) / "data", ["embedder", "store", "search", "gateway"], HYATLAS_MODE="lite"
        ) as stack,
    ):
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            started = time.perf_counter()
            ids = await ingest(http, stack.base_url, turns, args.concurrency)
            ingest_s = time.perf_counter() - started
            print(f"ingested in {ingest_s:.1f}s ({len(ids) / ingest_s:.0f} turns/s)", flush=True)
            results = {}
            for reader in args.readers:
                results[reader] = await ask(
                    http, stack.base_url, questions, ids, reader, args.min_score
                )
                print_table(reader, results[reader])
    return {
        "data": str(args.data),
        "turns": len(ids),
        "questions": len(questions),
        "min_score": args.min_score,
        "ingest_turns_per_s": round(len(ids) / ingest_s, 1),
        "readers": results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--readers", nargs="+", default=["keyword", "vector", "hybrid"])
    parser.add_argument(
        "--min-score",
        type=float,
        default=None,
        help="sent with every search; unset: the server's HYATLAS_MIN_SCORE",
    )
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    if not args.data.exists():
        print(f"no data at {args.data}", file=sys.stderr)
        return 1
    report = asyncio.run(run(args))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "locomo_retrieval.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
