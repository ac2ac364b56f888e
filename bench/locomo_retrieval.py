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
from typing import Any

import aiohttp

from bench.postgres import add_backend_argument, results_file, throwaway
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
    session: str


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
                rows.append(
                    Turn(turn["dia_id"], f"{turn['speaker']}: {turn['text']}", at, f"session_{n}")
                )
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
    http: aiohttp.ClientSession, base: str, turns: dict[str, list[Turn]]
) -> dict[str, str]:
    """Writes every turn as one memory, each conversation in order under its session, as a
    client would (conversations in parallel); returns memory id -> dia_id."""
    ids: dict[str, str] = {}

    async def add_all(owner: str, rows: list[Turn]) -> None:
        for turn in rows:
            body = {
                "text": turn.text,
                "user_id": owner,
                "agent_id": "locomo",
                "session_id": turn.session,
                "event_at": turn.event_at,
                "metadata": {"dia_id": turn.dia_id},
            }
            async with http.post(f"{base}/api/v1/add", json=body) as reply:
                data = await reply.json()
                if reply.status != 200:
                    raise RuntimeError(f"add failed: {reply.status} {data}")
                ids[data["memory_id"]] = f"{owner}/{turn.dia_id}"

    await asyncio.gather(*(add_all(owner, rows) for owner, rows in turns.items()))
    return ids


async def ask(
    http: aiohttp.ClientSession,
    base: str,
    questions: list[Question],
    ids: dict[str, str],
    reader: str,
    min_score: float | None,
    skip: tuple[str, ...] = (),
    ranks: list[dict[str, object]] | None = None,
) -> dict[str, object]:
    """Asks every question with one reader; returns the metric table and latencies. With
    ranks, each question's top 10 is appended to it (for reading where a reader misses)."""
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
        if skip:
            body["skip_stages"] = list(skip)
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
        if ranks is not None:
            ranks.append(
                {
                    "reader": reader,
                    "category": CATEGORIES[q.category],
                    "question": q.text,
                    "evidence": sorted(evidence),
                    "top10": ranked[:10],
                }
            )
    latencies.sort()
    return {
        "metrics": {name: s.means() for name, s in groups.items()},
        "latency_ms": {
            "p50": round(statistics.median(latencies), 2),
            "p95": round(latencies[int(0.95 * (len(latencies) - 1))], 2),
        },
    }


COLUMNS = [
    "recall_any@5",
    "recall_any@10",
    "recall_all@5",
    "recall_all@10",
    "evidence_frac@10",
    "ndcg@10",
]
# What the ablation switches off, one at a time: every stage that can change the order.
ABLATION = (
    "context_keys",
    "relaxed_keywords",
    "dates",
    "times",
    "entities",
    "speaker",
    "recency",
    "usage",
    "dedupe",
    "near_duplicates",
    "sittings",
    "replies",
    "mmr",
)


def overall(result: dict[str, Any]) -> dict[str, float]:
    return result["metrics"]["overall"]


def print_checks(results: dict[str, dict[str, Any]]) -> dict[str, object]:
    """The issue's checks on the hybrid: recall, NDCG, no category under BM25, latency ratio."""
    if not {"hybrid", "keyword", "rrf"} <= set(results):
        return {}
    hybrid, keyword = results["hybrid"]["metrics"], results["keyword"]["metrics"]
    below = [
        name
        for name in CATEGORIES.values()
        if hybrid[name]["recall_any@10"] < keyword[name]["recall_any@10"]
    ]
    ratio = results["hybrid"]["latency_ms"]["p95"] / results["rrf"]["latency_ms"]["p95"]
    checks = {
        "recall_any@10": hybrid["overall"]["recall_any@10"],
        "ndcg@10": hybrid["overall"]["ndcg@10"],
        "categories_below_bm25": below,
        "p95_vs_plain_hybrid": round(ratio, 2),
    }
    print(
        f"\nchecks: recall_any@10 {checks['recall_any@10']:.3f} (>= 0.80), ndcg@10 "
        f"{checks['ndcg@10']:.3f} (>= 0.55), categories below BM25: {below or 'none'}, "
        f"p95 {ratio:.2f}x the plain hybrid (<= 2)"
    )
    return checks


def print_ablation(full: dict[str, Any], off: dict[str, dict[str, Any]]) -> None:
    base = overall(full)
    print(
        f"\nablation: hybrid with one stage off at a time (full: recall_any@10 "
        f"{base['recall_any@10']:.3f}, ndcg@10 {base['ndcg@10']:.3f}, "
        f"p95 {full['latency_ms']['p95']:.1f} ms)"
    )
    print(
        f"{'stage off':<18} {'recall_any@10':>14} {'delta':>8} {'ndcg@10':>9} {'delta':>8} "
        f"{'p95 ms':>8}"
    )
    for name, result in off.items():
        m = overall(result)
        print(
            f"{name:<18} {m['recall_any@10']:>14.3f} "
            f"{m['recall_any@10'] - base['recall_any@10']:>+8.3f} {m['ndcg@10']:>9.3f} "
            f"{m['ndcg@10'] - base['ndcg@10']:>+8.3f} {result['latency_ms']['p95']:>8.1f}"
        )


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
        throwaway(args.backend, Path(tmp) / "postgres") as databases,
        running_stack(
            Path(tmp) / "data",
            ["embedder", "store", "search", "gateway"],
            HYATLAS_MODE="lite",
            **({"HYATLAS_STORE_DSN": databases.new_dsn()} if databases else {}),
        ) as stack,
    ):
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            started = time.perf_counter()
            ids = await ingest(http, stack.base_url, turns)
            ingest_s = time.perf_counter() - started
            print(f"ingested in {ingest_s:.1f}s ({len(ids) / ingest_s:.0f} turns/s)", flush=True)
            results: dict[str, dict[str, Any]] = {}
            ranks: list[dict[str, object]] | None = [] if args.ranks else None
            for reader in args.readers:
                results[reader] = await ask(
                    http, stack.base_url, questions, ids, reader, args.min_score, (), ranks
                )
                print_table(reader, results[reader])
            checks = print_checks(results)
            ablation: dict[str, dict[str, Any]] = {}
            if args.ablation:
                full = results.get("hybrid") or await ask(
                    http, stack.base_url, questions, ids, "hybrid", args.min_score
                )
                for name in ABLATION:
                    ablation[name] = await ask(
                        http, stack.base_url, questions, ids, "hybrid", args.min_score, (name,)
                    )
                print_ablation(full, ablation)
    if ranks is not None:
        args.ranks.write_text("".join(json.dumps(row) + "\n" for row in ranks))
    return {
        "backend": args.backend,
        "data": str(args.data),
        "turns": len(ids),
        "questions": len(questions),
        "min_score": args.min_score,
        "ingest_turns_per_s": round(len(ids) / ingest_s, 1),
        "readers": results,
        "checks": checks,
        "ablation": {
            name: {"overall": overall(r), "latency_ms": r["latency_ms"]}
            for name, r in ablation.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument(
        "--readers",
        nargs="+",
        default=["keyword", "vector", "rrf", "hybrid"],
        help="rrf is the plain reciprocal-rank hybrid the latency check compares with",
    )
    parser.add_argument(
        "--min-score",
        type=float,
        default=None,
        help="sent with every search; unset: the server's HYATLAS_MIN_SCORE",
    )
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="also run the hybrid with each stage switched off in turn (skip_stages)",
    )
    add_backend_argument(parser)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the results file (default bench/results/locomo_retrieval.json, "
        "locomo_retrieval_postgres.json on PostgreSQL)",
    )
    parser.add_argument(
        "--ranks",
        type=Path,
        default=None,
        help="also write each question's top 10 per reader, with its category and evidence "
        "turns, as JSON lines (owner/dia_id), to see where a reader misses",
    )
    args = parser.parse_args()
    if not args.data.exists():
        print(f"no data at {args.data}", file=sys.stderr)
        return 1
    report = asyncio.run(run(args))
    out = args.out or results_file(RESULTS, "locomo_retrieval", args.backend)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
