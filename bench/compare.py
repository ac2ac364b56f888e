"""This project through REST against chromadb in-process: same model, texts and threads, one run.

The store runs on SQLite or on a throwaway PostgreSQL with pgvector (`--backend`), there as one
or several store processes on one database (`--store-replicas`); `--no-peer` leaves chromadb
out, so a backend can be grown to sizes chromadb would take too long to reach.

For each owner layout (one owner; the same memories spread over many owners) a fresh lite stack
(`scripts/run.py`: supervisord and every service) and a fresh chromadb worker
(bench/chroma_worker.py under .venv-bench, the project's own ONNX encoder as its embedding
function) grow through the sizes together. Adds and searches alternate between the two, chunk by
chunk and query by query, so machine noise hits both. chromadb times its calls inside its own
process; ours are timed by the REST client. Prints a markdown table and writes
bench/results/compare.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import numpy as np

from bench.locomo_retrieval import DEFAULT_DATA, Question, Turn, load
from bench.postgres import Databases, add_backend_argument, throwaway
from bench.seeding import Seeder
from services.embedder.models import find_model_files
from services.embedder.onnx_encoder import OnnxEncoder
from services.store.keys import clauses
from services.store.pg import indexes
from tests.support import base_env, free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"
WORKER = ROOT / "bench" / "chroma_worker.py"
K = 10
ONE_CLIENT_CHUNK = 25
BATCH_CHUNK = 512
PEER_BATCH = 64
FLOOR_BATCH = 256
CLIENTS = 8
MIB = 1 << 20
WARM_UP = 5
SEED_CHUNK = 2000


# --- texts ---------------------------------------------------------------------------------


def memory_parts(turns: list[str], count: int) -> list[tuple[int, int | None]]:
    """count distinct memories, the same on every run, as the turns they are made of: every
    LoCoMo turn once, then pairs of turns (turn a followed by a turn picked by a fixed stride,
    often from another conversation)."""
    found: list[tuple[int, int | None]] = []
    seen: set[str] = set()
    total = len(turns)
    for variant in itertools.count():
        if variant > total:
            raise ValueError(f"cannot derive {count} distinct texts from {total} turns")
        for a in range(total):
            b = None if variant == 0 else (a + variant * 977) % total
            if b == a:
                continue
            text = memory_text(turns, (a, b))
            if text not in seen:
                seen.add(text)
                found.append((a, b))
                if len(found) == count:
                    return found
    raise AssertionError("unreachable")


def memory_text(turns: list[str], part: tuple[int, int | None]) -> str:
    """The text of one memory."""
    a, b = part
    return turns[a] if b is None else f"{turns[a]} {turns[b]}"


@dataclass(frozen=True)
class Probe:
    """A question asked of both sides, and the texts of the turns that answer it."""

    text: str
    answers: tuple[str, ...]


def probes(questions: list[Question], turns_by_owner: dict[str, list[Turn]]) -> list[Probe]:
    """The questions with their evidence turns' texts: a memory holding one answers it."""
    texts = {(owner, t.dia_id): t.text for owner, rows in turns_by_owner.items() for t in rows}
    return [
        Probe(q.text, tuple(texts[(q.owner, e)] for e in sorted(q.evidence))) for q in questions
    ]


def answered(probe: Probe, found: list[str]) -> bool:
    """Whether a memory among the first K holds one of the turns that answer the question."""
    return any(answer in text for text in found[:K] for answer in probe.answers)


def owner_of(index: int, owners: int) -> str:
    """The owner of memory number index when memories are spread over owners."""
    return "bench" if owners == 1 else f"u{index % owners:04d}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(statistics.median(values), 2),
        "p95": round(percentile(values, 0.95), 2),
        "p99": round(percentile(values, 0.99), 2),
        "max": round(max(values), 2),
        "mean": round(statistics.fmean(values), 2),
        "n": len(values),
    }


# --- processes -----------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    """The direct children of pid, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name in parentheses may hold spaces; the parent pid follows it
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def memory_of(pid: int) -> dict[str, float]:
    """Resident and proportional set size of one process, MiB (PSS shares libraries fairly)."""
    fields: dict[str, float] = {}
    for name, key in (("status", "VmRSS:"), ("status", "VmHWM:"), ("smaps_rollup", "Pss:")):
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            if line.startswith(key):
                fields[key.rstrip(":").lower()] = round(int(line.split()[1]) / 1024, 1)
    return fields


def service_name(pid: int) -> str:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    module = args[args.index(b"-m") + 1].decode() if b"-m" in args else args[0].decode()
    return module.removeprefix("services.")


def disk_bytes(folder: Path, skip: Path | None = None) -> int:
    """Bytes the files under folder take on disk (allocated blocks, as du counts them)."""
    total = 0
    for path in folder.rglob("*"):
        if skip is not None and path.is_relative_to(skip):
            continue
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_blocks * 512
    return total


@dataclass
class Project:
    """The whole stack under supervisord, as `make run` starts it."""

    proc: subprocess.Popen[bytes]
    data_dir: Path
    run_dir: Path
    base_url: str
    log_path: Path
    databases: Databases | None
    dsn: str

    def services(self) -> dict[str, int]:
        """Service name -> pid: the children of supervisord (itself run.py's child); a second
        replica of a service is name-2, and so on."""
        found: dict[str, int] = {}
        for supervisord in children(self.proc.pid):
            for pid in children(supervisord):
                name = service_name(pid)
                copies = sum(1 for known in found if known.split("-")[0] == name)
                found[name if not copies else f"{name}-{copies + 1}"] = pid
        return found

    def memory(self) -> dict[str, dict[str, float]]:
        """Service name -> its memory figures; with PostgreSQL also the server's processes,
        summed (PSS shares its buffers fairly among them)."""
        found = {name: memory_of(pid) for name, pid in self.services().items()}
        server = self.databases.server_pid() if self.databases else None
        if server is not None:
            each = []
            for pid in [server, *children(server)]:
                with suppress(FileNotFoundError, ProcessLookupError):  # a worker that ended
                    each.append(memory_of(pid))
            found["postgres"] = {key: round(sum(m[key] for m in each), 1) for key in each[0]}
        return found

    def disk_bytes(self) -> int:
        """What the stored memories take: the data dir, and with PostgreSQL its database."""
        total = disk_bytes(self.data_dir, skip=self.run_dir)
        if self.databases is not None:
            total += self.databases.database_bytes(self.dsn)
        return total


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(json.load(reply).get("ready"))
    except (OSError, ValueError):
        return False


LOG_TAIL_CHARS = 8000
"""How much of the services' log a failure prints."""


@contextmanager
def project_stack(
    tmp: Path, args: argparse.Namespace, databases: Databases | None
) -> Iterator[Project]:
    """scripts/run.py in lite mode on a temp data dir and a free port, its store on SQLite or
    on a fresh database of the given server (as args.store_replicas processes); stopped on the
    way out."""
    data = tmp / "data"
    port = free_port()
    dsn = databases.new_dsn() if databases else ""
    env = base_env(
        data,
        HYATLAS_GO_PORT=str(port),
        HYATLAS_EMBED_THREADS=str(args.threads),
        HYATLAS_LOG_LEVEL=args.log_level.upper(),
        HYATLAS_STORE_REPLICAS=str(args.store_replicas),
        HYATLAS_EMBED_POOLED_SPANS=args.pooled_spans,
        **({"HYATLAS_STORE_DSN": dsn} if dsn else {}),
    )
    # The embedder's queue as `make run` has it (base_env widens it for tests on a busy machine).
    del env["HYATLAS_EMBED_MAX_QUEUE"]
    log_path = tmp / "services.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / "run.py")],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base_url = f"http://127.0.0.1:{port}"
    project = Project(
        proc, data, Path(env["HYATLAS_RUN_DIR"]), base_url, log_path, databases, dsn
    )
    try:
        deadline = time.monotonic() + 180
        while not ready(f"{project.base_url}/readyz"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the stack did not get ready")
            time.sleep(0.25)
        yield project
    except Exception:
        # The stack did not start or a step failed: what the services logged last tells why
        # (the temp dir goes away).
        tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        print(f"the services' log, last lines:\n{tail}", file=sys.stderr)
        raise
    finally:
        left = [pid for s in children(proc.pid) for pid in [s, *children(s)]]
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in left:  # normally gone with supervisord; never leave a service behind
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class Peer:
    """The chromadb worker: one JSON command a line in, one JSON answer a line out."""

    def __init__(self, proc: asyncio.subprocess.Process, persist_dir: Path) -> None:
        self.proc = proc
        self.persist_dir = persist_dir

    @classmethod
    async def start(cls, tmp: Path, threads: int) -> Peer:
        files = find_model_files(None)
        persist = tmp / "chroma"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HYATLAS_")}
        env |= {"PYTHONPATH": str(ROOT), "ANONYMIZED_TELEMETRY": "False"}
        with (tmp / "chroma.log").open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                str(BENCH_PYTHON),
                str(WORKER),
                str(files.onnx_path),
                str(files.tokenizer_path),
                str(threads),
                str(persist),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env=env,
                limit=1 << 26,
            )
        return cls(proc, persist)

    async def call(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the chromadb worker exited ({await self.proc.wait()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    async def stop(self) -> None:
        if self.proc.returncode is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "exit"}\n')
                await self.proc.stdin.drain()
                await asyncio.wait_for(self.proc.wait(), 30)
            except (OSError, TimeoutError):
                self.proc.kill()
                await self.proc.wait()


class SearchFailed(RuntimeError):
    """A search the server answered with an error."""


class Ours:
    """This project through its REST API."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str) -> None:
        self.http = http
        self.base = base_url

    async def add(self, text: str, owner: str) -> None:
        body = {"text": text, "user_id": owner}
        async with self.http.post(f"{self.base}/api/v1/add", json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"add: {reply.status} {await reply.text()}")

    async def add_one_at_a_time(self, texts: list[str], owners: list[str]) -> float:
        started = time.perf_counter()
        for text, owner in zip(texts, owners, strict=True):
            await self.add(text, owner)
        return time.perf_counter() - started

    async def add_concurrently(self, texts: list[str], owners: list[str], clients: int) -> float:
        work = iter(zip(texts, owners, strict=True))

        async def client() -> None:
            for text, owner in work:
                await self.add(text, owner)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return time.perf_counter() - started

    async def import_status(self) -> int:
        """The status of an import of a header alone: 501 (or 404/405) while not built."""
        header = json.dumps({"format": "hyatlas-export", "version": 1}) + "\n"
        async with self.http.post(
            f"{self.base}/api/v1/import",
            data=header.encode(),
            headers={"Content-Type": "application/x-ndjson"},
        ) as reply:
            return reply.status

    async def import_(self, texts: list[str], owners: list[str]) -> float:
        lines = [
            json.dumps({"type": "memory", "memory": {"user_id": owner, "content": text}})
            for text, owner in zip(texts, owners, strict=True)
        ]
        return await self.import_lines(lines)

    async def import_lines(self, memory_lines: list[str]) -> float:
        """Imports memory lines in one request; the seconds it took."""
        lines = [json.dumps({"format": "hyatlas-export", "version": 1}), *memory_lines]
        started = time.perf_counter()
        async with self.http.post(
            f"{self.base}/api/v1/import",
            data=("\n".join(lines) + "\n").encode(),
            headers={"Content-Type": "application/x-ndjson"},
        ) as reply:
            body = await reply.text()
        seconds = time.perf_counter() - started
        if reply.status != 200:
            raise RuntimeError(f"import: {reply.status} {body[:500]}")
        data = json.loads(body)
        if data.get("imported") != len(memory_lines):
            raise RuntimeError(
                f"import took {data.get('imported')} of {len(memory_lines)}: {body[:500]}"
            )
        return seconds

    async def search(self, query: str, owner: str, reader: str) -> tuple[float, list[str]]:
        body = {"query": query, "user_id": owner, "limit": K, "reader": reader}
        started = time.perf_counter()
        async with self.http.post(f"{self.base}/api/v1/search", json=body) as reply:
            data = await reply.json()
        ms = (time.perf_counter() - started) * 1000.0
        if reply.status != 200:
            raise SearchFailed(f"{reply.status} {data} after {ms:.0f} ms")
        found = [
            memory["content"]
            for channel in data["order"]
            if channel != "now"
            for memory in data["memories"].get(channel, [])
        ]
        return ms, found

    async def flush(self, tries: int = 1) -> None:
        """POST /api/v1/flush; a 503 (the write deadline passed while the store worked) is
        tried again, up to `tries` times in all: the store goes on with the work meanwhile."""
        for tried in range(1, tries + 1):
            async with self.http.post(f"{self.base}/api/v1/flush", json={}) as reply:
                if reply.status == 200:
                    return
                if reply.status != 503 or tried == tries:
                    raise RuntimeError(f"flush: {reply.status} {await reply.text()}")


# --- one owner layout, grown through the sizes ---------------------------------------------


def progress(text: str) -> None:
    """A line that overwrites itself, on a terminal only."""
    if sys.stdout.isatty():
        print(f"  {text:<40}", end="\r", flush=True)


Step = Callable[[], Awaitable[None]]


async def alternate(index: int, *given: Step | None) -> None:
    """Runs the steps in an order that rotates with index, so neither side always goes first
    (None: a step of the peer when there is none)."""
    steps = [step for step in given if step is not None]
    shift = index % len(steps)
    for step in steps[shift:] + steps[:shift]:
        await step()


@dataclass
class Tally:
    count: int = 0
    seconds: float = 0.0

    def rate(self) -> float | None:
        return round(self.count / self.seconds, 1) if self.seconds else None


async def grow(
    ours: Ours,
    peer: Peer | None,
    texts: list[str],
    owners: list[str],
    start: int,
    bulk: bool,
    args: argparse.Namespace,
    seeder: Seeder | None,
    dsn: str = "",
) -> dict[str, Any]:
    """Adds texts[start:] to both sides and measures each add path on its own slice (with a
    seeder, all but the last args.measured are seeded first, untimed)."""
    n = len(texts)
    seeded, built = Tally(), Tally()
    if seeder is not None and n - start > args.measured:
        began = time.perf_counter()
        async with hnsw_built_after(dsn, args.defer_indexes) as built:
            await seed(ours, peer, seeder, texts, owners, start, n - args.measured)
        seeded = Tally(n - args.measured - start, time.perf_counter() - began)
        built.count = seeded.count
        start = n - args.measured
    remaining = n - start
    one = min(args.one_client, remaining // 4)
    batched = min(args.batched, (remaining - one) // 2) if bulk else remaining - one
    tallies = {name: Tally() for name in (
        "ours_1", "peer_1", "ours_8", "peer_64", "ours_bulk", "ours_bulk_texts",
        "peer_64_in_bulk", "floor_batched",
    )}

    def peer_add(name: str, lo: int, hi: int, batch: int) -> Step | None:
        if peer is None:
            return None

        async def step() -> None:
            reply = await peer.call(
                op="add",
                ids=[f"m{i}" for i in range(lo, hi)],
                docs=texts[lo:hi],
                metas=[{"user_id": o} for o in owners[lo:hi]],
                batch=batch,
            )
            tallies[name].count += hi - lo
            tallies[name].seconds += reply["seconds"]

        return step

    def ours_step(name: str, lo: int, hi: int, how: str) -> Callable[[], Awaitable[None]]:
        async def step() -> None:
            if how == "one":
                seconds = await ours.add_one_at_a_time(texts[lo:hi], owners[lo:hi])
            elif how == "clients":
                seconds = await ours.add_concurrently(texts[lo:hi], owners[lo:hi], CLIENTS)
            else:
                seconds = await ours.import_(texts[lo:hi], owners[lo:hi])
                # A memory is one model input; its sentences (services/store/keys.py) are more
                # unless their vectors are pooled from its run.
                tallies["ours_bulk_texts"].count += sum(
                    1 if args.pooled_spans == "on" else 1 + len(clauses(t)) for t in texts[lo:hi]
                )
                tallies["ours_bulk_texts"].seconds += seconds
            tallies[name].count += hi - lo
            tallies[name].seconds += seconds

        return step

    def floor_step(lo: int, hi: int) -> Step | None:
        if peer is None:
            return None

        async def step() -> None:
            if tallies["floor_batched"].count >= args.floor_texts:
                return
            reply = await peer.call(op="embed", texts=texts[lo:hi], batch=FLOOR_BATCH)
            tallies["floor_batched"].count += hi - lo
            tallies["floor_batched"].seconds += reply["seconds"]

        return step

    lo = start
    for index, chunk_lo in enumerate(range(lo, lo + one, ONE_CLIENT_CHUNK)):
        hi = min(chunk_lo + ONE_CLIENT_CHUNK, lo + one)
        await alternate(
            index, peer_add("peer_1", chunk_lo, hi, 1), ours_step("ours_1", chunk_lo, hi, "one")
        )
    lo += one
    for index, chunk_lo in enumerate(range(lo, lo + batched, BATCH_CHUNK)):
        hi = min(chunk_lo + BATCH_CHUNK, lo + batched)
        await alternate(
            index,
            peer_add("peer_64", chunk_lo, hi, PEER_BATCH),
            ours_step("ours_8", chunk_lo, hi, "clients"),
            # Without the bulk path the floor is measured here; with it, on the import's texts.
            None if bulk else floor_step(chunk_lo, hi),
        )
        progress(f"added {hi}/{n}")
    lo += batched
    for index, chunk_lo in enumerate(range(lo, n, args.import_chunk)):
        hi = min(chunk_lo + args.import_chunk, n)
        await alternate(
            index,
            peer_add("peer_64_in_bulk", chunk_lo, hi, PEER_BATCH),
            ours_step("ours_bulk", chunk_lo, hi, "import"),
            floor_step(chunk_lo, hi),
        )
        progress(f"imported {hi}/{n}")
    progress("")
    # seeded: the untimed part, here given its rate (with chromadb's seeding in between, and
    # the HNSW build when deferred, which index_build times on its own)
    tallies["seeded"] = seeded
    tallies["index_build"] = built
    return {
        name: {"count": t.count, "seconds": round(t.seconds, 2), "per_s": t.rate()}
        for name, t in tallies.items()
    }


@asynccontextmanager
async def hnsw_built_after(dsn: str, memory: str | None) -> AsyncIterator[Tally]:
    """With a PostgreSQL store and memory given: its HNSW indexes deferred while the body runs,
    then built with that maintenance_work_mem (services/store/pg/indexes.py); the tally times
    the build."""
    built = Tally()
    if not dsn or memory is None:
        yield built
        return
    conn = await asyncpg.connect(dsn)
    try:
        await indexes.defer(conn)
        yield built
        progress("building the HNSW indexes")
        began = time.perf_counter()
        await indexes.build(conn, memory)
        built.seconds = time.perf_counter() - began
    finally:
        await conn.close()


async def seed(
    ours: Ours,
    peer: Peer | None,
    seeder: Seeder,
    texts: list[str],
    owners: list[str],
    lo: int,
    hi: int,
) -> None:
    """Memories lo..hi to both sides with the seeder's vectors (no model run), untimed."""
    spread = len(set(owners[: min(len(owners), 5000)]))  # owner of i is owners[i % spread]
    for chunk_lo in range(lo, hi, SEED_CHUNK):
        chunk_hi = min(chunk_lo + SEED_CHUNK, hi)
        lines = [
            seeder.import_line(
                i,
                texts[i],
                owners[i],
                texts[i - spread] if i >= spread else None,
                texts[i + spread] if i + spread < hi else None,
            )
            for i in range(chunk_lo, chunk_hi)
        ]
        await ours.import_lines(lines)
        if peer is None:
            progress(f"seeded {chunk_hi}/{hi}")
            continue
        await peer.call(
            op="add_vectors",
            ids=[f"m{i}" for i in range(chunk_lo, chunk_hi)],
            docs=texts[chunk_lo:chunk_hi],
            metas=[{"user_id": o} for o in owners[chunk_lo:chunk_hi]],
            b64=seeder.matrix(chunk_lo, chunk_hi),
        )
        progress(f"seeded {chunk_hi}/{hi}")
    # The store's keyword indexes apply what the seeding wrote after its commits; the flush
    # waits for them, so that work is the seeding's and not the measured adds' and searches'.
    await ours.flush(tries=60)


SEARCH_LINE = re.compile(
    r"search user=\S+ sources=(?P<sources>\S+) .*total=(?P<total>[\d.]+)ms "
    r"retrieval=(?P<retrieval>[\d.]+)ms \[(?P<timings>[^\]]*)\] stages \[(?P<stages>[^\]]*)\]"
)


def stage_times(log_path: Path, offset: int) -> dict[str, dict[str, float]]:
    """Median per-stage times from the search service's debug lines written after offset."""
    samples: dict[str, dict[str, list[float]]] = {}
    with log_path.open("rb") as log:
        log.seek(offset)
        for raw in log:
            match = SEARCH_LINE.search(raw.decode(errors="replace"))
            if not match:
                continue
            into = samples.setdefault(match["sources"], {})
            into.setdefault("total", []).append(float(match["total"]))
            into.setdefault("retrieval", []).append(float(match["retrieval"]))
            for item in f"{match['timings']} {match['stages']}".split():
                name, _, value = item.partition("=")
                into.setdefault(name, []).append(float(value.split("ms")[0]))
    return {
        sources: {name: round(statistics.median(v), 2) for name, v in by.items()}
        for sources, by in samples.items()
    }


async def searches(
    ours: Ours, peer: Peer | None, questions: list[Probe], owners: int, log_path: Path
) -> dict[str, Any]:
    """Every question on every side, the order rotating per question; warm-up first. With one
    owner, also the share of questions each side answers (see answered); spread over owners,
    a question's turns mostly belong to others, so it is not counted."""
    times: dict[str, list[float]] = {"hybrid": [], "vector": [], "chromadb": [], "floor": []}
    found: dict[str, list[int]] = {"hybrid": [], "vector": [], "chromadb": []}
    hits: dict[str, list[bool]] = {"hybrid": [], "vector": [], "chromadb": []}
    failed: dict[str, list[str]] = {}

    for warm in questions[:WARM_UP]:
        await ours.search(warm.text, owner_of(0, owners), "hybrid")
        await ours.search(warm.text, owner_of(0, owners), "vector")
        if peer is not None:
            await peer.call(op="query", text=warm.text, k=K, where=None)
    offset = await asyncio.to_thread(lambda: log_path.stat().st_size)
    for index, question in enumerate(questions):
        owner = owner_of(index, owners)
        where = {"user_id": owner} if owners > 1 else None

        def ours_step(
            reader: str, q: Probe = question, o: str = owner
        ) -> Callable[[], Awaitable[None]]:
            async def step() -> None:
                try:
                    ms, texts = await ours.search(q.text, o, reader)
                except SearchFailed as exc:  # counted and shown, not hidden in percentiles
                    failed.setdefault(reader, []).append(str(exc))
                    print(f"{reader} search failed: {exc}", flush=True)
                    return
                times[reader].append(ms)
                found[reader].append(len(texts))
                hits[reader].append(answered(q, texts))

            return step

        def peer_steps(
            peer: Peer, q: Probe = question, w: dict[str, str] | None = where
        ) -> tuple[Step, Step]:
            async def peer_query() -> None:
                reply = await peer.call(op="query", text=q.text, k=K, where=w)
                times["chromadb"].append(reply["ms"])
                found["chromadb"].append(len(reply["docs"]))
                hits["chromadb"].append(answered(q, reply["docs"]))

            async def floor_embed() -> None:
                times["floor"].append((await peer.call(op="embed_one", text=q.text))["ms"])

            return peer_query, floor_embed

        query, floor = peer_steps(peer) if peer is not None else (None, None)
        await alternate(index, query, ours_step("hybrid"), ours_step("vector"), floor)
    return {
        "latency_ms": {name: latency(v) for name, v in times.items() if v},
        "mean_results": {name: round(statistics.fmean(v), 2) for name, v in found.items() if v},
        "answered": (
            {name: round(statistics.fmean(v), 3) for name, v in hits.items() if v}
            if owners == 1
            else {}
        ),
        "search_service_stage_ms": stage_times(log_path, offset),
        "failed": failed,
    }


async def against_smallest(
    big: Project, owners: int, sizes: list[int], texts: list[str], questions: list[Probe],
    args: argparse.Namespace, databases: Databases | None, seeder: Seeder,
) -> dict[str, Any]:
    """The hybrid at the largest size against the smallest, measured at the same time: a second
    stack seeded to the smallest size (the seeder's vectors, no adds timed) and each question
    asked of both stacks in turn, the order rotating, so the machine's drift hits both (the
    sizes' own rows are measured minutes apart)."""
    small_size = sizes[0]
    times: dict[str, list[float]] = {"small": [], "big": []}
    failed: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-compare-small-") as name,
        project_stack(Path(name), args, databases) as small,
    ):
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            stacks = {"small": Ours(http, small.base_url), "big": Ours(http, big.base_url)}
            owner_ids = [owner_of(i, owners) for i in range(small_size)]
            await seed(stacks["small"], None, seeder, texts, owner_ids, 0, small_size)

            def asking(side: str, text: str, owner: str) -> Step:
                async def step() -> None:
                    try:
                        times[side].append((await stacks[side].search(text, owner, "hybrid"))[0])
                    except SearchFailed as exc:
                        failed.append(f"{side}: {exc}")

                return step

            for warm in questions[:WARM_UP]:
                for side in stacks:
                    await asking(side, warm.text, owner_of(0, owners))()
            for values in times.values():
                values.clear()
            for index, question in enumerate(questions):
                owner = owner_of(index, owners)
                await alternate(index, *(asking(side, question.text, owner) for side in stacks))
    return {
        "sizes": [small_size, sizes[-1]],
        "hybrid_ms": {side: latency(values) for side, values in times.items()},
        "failed": failed,
    }


async def run_layout(
    owners: int,
    sizes: list[int],
    texts: list[str],
    questions: list[Probe],
    args: argparse.Namespace,
    seeding: tuple[list[str], list[tuple[int, int | None]]] | None,
    databases: Databases | None,
) -> list[dict[str, Any]]:
    """One fresh stack and one fresh chromadb (unless args.no_peer), grown through the sizes."""
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as name:
        tmp = Path(name)
        with project_stack(tmp, args, databases) as project:
            peer = None if args.no_peer else await Peer.start(tmp, args.threads)
            try:
                if peer is not None:
                    await peer.call(op="embed_one", text="warm up")
                seeder = await make_seeder(seeding, peer, args.threads)
                rows = await grow_through(
                    project, peer, owners, sizes, texts, questions, args, seeder
                )
                if seeder is not None and len(sizes) > 1 and rows[-1]["bulk_path"]:
                    rows[-1]["against_smallest"] = await against_smallest(
                        project, owners, sizes, texts, questions, args, databases, seeder
                    )
                    print(markdown(rows[-1:]), flush=True)
            finally:
                if peer is not None:
                    await peer.stop()
        embedded = embedded_texts(tmp / "services.log")  # logged when the embedder stops
    if embedded is not None and rows:
        # every search embeds its query once; the rest was embedded for the stored memories
        searched = sum(
            r["search"]["latency_ms"][reader]["n"] + WARM_UP for r in rows
            for reader in ("hybrid", "vector")
        )
        # Seeded memories brought their vectors: count only those added through the model.
        through_model = sum(
            r["adds"][name]["count"] for r in rows for name in ("ours_1", "ours_8", "ours_bulk")
        )
        per_memory = (embedded - searched) / max(through_model, 1)
        rows[-1]["embedded_texts_per_memory"] = round(per_memory, 2)
        print(f"owners {owners}: the embedder ran {embedded} texts, "
              f"{per_memory:.2f} per memory added through the model (queries taken out)",
              flush=True)
    return rows


async def make_seeder(
    seeding: tuple[list[str], list[tuple[int, int | None]]] | None,
    peer: Peer | None,
    threads: int,
) -> Seeder | None:
    """The seeder of a run that seeds: every turn embedded once, by chromadb's worker or,
    without one, by the project's encoder in this process (the same model and code)."""
    if seeding is None:
        return None
    turns, parts = seeding
    files = find_model_files(None)
    if peer is not None:
        reply = await peer.call(op="vectors", texts=turns)
        matrix = np.frombuffer(base64.b64decode(reply["b64"]), dtype="<f4")
    else:
        encoder = OnnxEncoder(files, threads)
        matrix = (await asyncio.to_thread(encoder.encode, turns)).astype("<f4")
    return Seeder(turns, parts, matrix.reshape(len(turns), -1), files.spec.model_id)


async def grow_through(
    project: Project,
    peer: Peer | None,
    owners: int,
    sizes: list[int],
    texts: list[str],
    questions: list[Probe],
    args: argparse.Namespace,
    seeder: Seeder | None,
) -> list[dict[str, Any]]:
    """Grows both sides through the sizes; a row of figures at each."""
    rows: list[dict[str, Any]] = []
    owner_ids = [owner_of(i, owners) for i in range(len(texts))]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        ours = Ours(http, project.base_url)
        status = await ours.import_status()
        bulk = status not in (404, 405, 501)
        print(f"owners {owners}: /api/v1/import answers {status}; bulk path "
              f"{'used' if bulk else 'n/a (seeding with 8 concurrent adds)'}", flush=True)
        stored = 0
        for size in sizes:
            load_before = os.getloadavg()
            started = time.perf_counter()
            adds = await grow(
                ours, peer, texts[:size], owner_ids[:size], stored, bulk, args,
                seeder if bulk else None, project.dsn,
            )
            stored = size
            grown_s = time.perf_counter() - started
            found = await searches(ours, peer, questions, owners, project.log_path)
            await ours.flush()
            services = project.memory()
            ours_disk = project.disk_bytes()
            row = {
                "size": size,
                "owners": owners,
                "backend": args.backend,
                "store_replicas": args.store_replicas,
                "pooled_spans": args.pooled_spans,
                "bulk_path": bulk,
                "import_status": status,
                "adds": adds,
                "search": found,
                "rss_mib": {
                    "ours": round(sum(s["vmrss"] for s in services.values()), 1),
                    "ours_pss": round(sum(s["pss"] for s in services.values()), 1),
                    "ours_by_service": services,
                },
                "disk": {
                    "ours_mib": round(ours_disk / MIB, 1),
                    "ours_kib_per_memory": round(ours_disk / 1024 / size, 2),
                },
                "grow_s": round(grown_s, 1),
                "load_avg_before": [round(x, 2) for x in load_before],
                "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            }
            if peer is not None:
                peer_memory = memory_of(peer.proc.pid)
                peer_disk = disk_bytes(peer.persist_dir)
                row["rss_mib"] |= {
                    "chromadb": peer_memory["vmrss"],
                    "chromadb_pss": peer_memory["pss"],
                    "chromadb_peak": peer_memory["vmhwm"],
                }
                row["disk"] |= {
                    "chromadb_mib": round(peer_disk / MIB, 1),
                    "chromadb_kib_per_memory": round(peer_disk / 1024 / size, 2),
                }
            rows.append(row)
            print(markdown([row]), flush=True)
            if stages := stage_lines([row]):
                print(stages, flush=True)
    return rows


def embedded_texts(log_path: Path) -> int | None:
    """Texts the embedder ran in all, from the line it logs when it stops."""
    for line in log_path.read_text(errors="replace").splitlines():
        match = re.search(r"batcher embedded (\d+) texts in (\d+) runs", line)
        if match:
            return int(match[1])
    return None


# --- output --------------------------------------------------------------------------------


def ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}×" if ours and theirs else "n/a"


def p50_p95(lat: dict[str, dict[str, float]], name: str) -> str:
    """"p50 / p95" of one latency series, n/a when it was not measured (no chromadb)."""
    return f"{lat[name]['p50']} / {lat[name]['p95']}" if name in lat else "n/a"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: our figure, chromadb's (or the floor's), and ours over theirs."""
    lines = [
        "| stored | owners | measure | HyAtlas | chromadb (or floor) | HyAtlas ÷ other |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        a, lat = row["adds"], row["search"]["latency_ms"]
        head = f"| {row['size']:,} | {row['owners']:,} "

        def add(measure: str, ours: str, theirs: str, r: str, head: str = head) -> None:
            lines.append(f"{head}| {measure} | {ours} | {theirs} | {r} |")

        add("adds/s, 1 client (chromadb: one-doc add)", f"{a['ours_1']['per_s']}",
            f"{a['peer_1']['per_s'] or 'n/a'}", ratio(a["ours_1"]["per_s"], a["peer_1"]["per_s"]))
        add(f"adds/s, {CLIENTS} clients (chromadb: {PEER_BATCH}-doc batches)",
            f"{a['ours_8']['per_s']}", f"{a['peer_64']['per_s'] or 'n/a'}",
            ratio(a["ours_8"]["per_s"], a["peer_64"]["per_s"]))
        floor = a["floor_batched"]["per_s"]
        bulk = a["ours_bulk"]["per_s"] if row["bulk_path"] else None
        add("bulk import memories/s (floor: raw batched embed, texts/s)",
            f"{bulk}" if bulk else "n/a", f"{floor or 'n/a'}", ratio(bulk, floor))
        texts = a.get("ours_bulk_texts", {}).get("per_s") if row["bulk_path"] else None
        add("bulk import model inputs/s: each memory, and its sentences unless pooled "
            "(floor: texts/s)",
            f"{texts}" if texts else "n/a", f"{floor or 'n/a'}", ratio(texts, floor))
        for reader in ("hybrid", "vector"):
            peer = lat.get("chromadb", {})
            add(f"search p50 / p95 ms, {reader} (chromadb: query)",
                p50_p95(lat, reader), p50_p95(lat, "chromadb"),
                f"{ratio(lat[reader]['p50'], peer.get('p50'))} / "
                f"{ratio(lat[reader]['p95'], peer.get('p95'))}")
        add("floor: raw single-query embed p50 / p95 ms", "", p50_p95(lat, "floor"), "")
        if share := row["search"].get("answered"):
            add(f"questions with an answering turn in the top {K}, hybrid / vector (chromadb)",
                f"{share.get('hybrid')} / {share.get('vector')}", f"{share.get('chromadb', 'n/a')}",
                ratio(share.get("hybrid"), share.get("chromadb")))
        rss = row["rss_mib"]
        postgres = " and PostgreSQL" if "postgres" in rss["ours_by_service"] else ""
        add(f"RSS MiB (all services{postgres} vs chromadb's process)", f"{rss['ours']}",
            f"{rss.get('chromadb', 'n/a')}", ratio(rss["ours"], rss.get("chromadb")))
        disk = row["disk"]
        add("disk KiB per memory", f"{disk['ours_kib_per_memory']}",
            f"{disk.get('chromadb_kib_per_memory', 'n/a')}",
            ratio(disk["ours_kib_per_memory"], disk.get("chromadb_kib_per_memory")))
        if turn := row.get("against_smallest"):
            small, big = turn["hybrid_ms"]["small"], turn["hybrid_ms"]["big"]
            add(f"hybrid p50 / p95 ms, this store and one of {turn['sizes'][0]:,} (seeded) asked "
                "in turn", f"{big['p50']} / {big['p95']}", f"{small['p50']} / {small['p95']}",
                f"{ratio(big['p50'], small['p50'])} / {ratio(big['p95'], small['p95'])}")
        if "embedded_texts_per_memory" in row:
            add("vectors made per memory added through the model (chromadb: 1)",
                f"{row['embedded_texts_per_memory']}", "1",
                f"{row['embedded_texts_per_memory']:.2f}×")
    return "\n".join(lines)


def backend_label(report: dict[str, Any]) -> str:
    """How a run's store was set up: SQLite, or PostgreSQL with how many store processes."""
    if report.get("backend", "sqlite") == "sqlite":
        return "SQLite"
    replicas = report.get("store_replicas", 1)
    return f"PostgreSQL, {replicas} store{'s' if replicas > 1 else ''}"


def backends_table(reports: list[dict[str, Any]]) -> str:
    """Runs side by side, one column each, at every size and owner layout they share."""
    measures: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("adds/s, 1 client", lambda r: f"{r['adds']['ours_1']['per_s']}"),
        (f"adds/s, {CLIENTS} clients", lambda r: f"{r['adds']['ours_8']['per_s']}"),
        ("bulk import memories/s (embedded)", lambda r: f"{r['adds']['ours_bulk']['per_s']}"),
        ("bulk import memories/s (seeding, vectors given)",
         lambda r: f"{r['adds'].get('seeded', {}).get('per_s') or 'n/a'}"),
        ("of which HNSW build s (--defer-indexes)",
         lambda r: f"{r['adds'].get('index_build', {}).get('seconds') or 'n/a'}"),
        ("search p50 / p95 ms, hybrid", lambda r: p50_p95(r["search"]["latency_ms"], "hybrid")),
        ("search p50 / p95 ms, vector", lambda r: p50_p95(r["search"]["latency_ms"], "vector")),
        ("searches failed, hybrid / vector", lambda r: " / ".join(
            str(len(r["search"].get("failed", {}).get(name, []))) for name in ("hybrid", "vector")
        )),
        ("RSS MiB, all services (and PostgreSQL)", lambda r: f"{r['rss_mib']['ours']}"),
        ("PSS MiB, all services (and PostgreSQL)", lambda r: f"{r['rss_mib']['ours_pss']}"),
        ("disk KiB per memory", lambda r: f"{r['disk']['ours_kib_per_memory']}"),
    ]
    by_run = [{(row["size"], row["owners"]): row for row in r["rows"]} for r in reports]
    shared = sorted(set.intersection(*(set(rows) for rows in by_run)), key=lambda k: (k[1], k[0]))
    lines = [
        "| stored | owners | measure | " + " | ".join(map(backend_label, reports)) + " |",
        "|---|---|---|" + "---|" * len(reports),
    ]
    for key in shared:
        for measure, value in measures:
            cells = " | ".join(value(rows[key]) for rows in by_run)
            lines.append(f"| {key[0]:,} | {key[1]:,} | {measure} | {cells} |")
    return "\n".join(lines)


def stage_lines(rows: list[dict[str, Any]]) -> str:
    """The search service's median per-stage times (only with --log-level debug)."""
    lines = []
    for row in rows:
        for sources, stages in row["search"]["search_service_stage_ms"].items():
            detail = ", ".join(f"{k} {v}" for k, v in stages.items())
            lines.append(f"{row['size']:,} stored, {row['owners']:,} owners, {sources}: {detail}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10000,100000", help="memories stored, ascending")
    parser.add_argument("--owners", default="1,1000", help="owner layouts, each its own run")
    parser.add_argument("--queries", type=int, default=200, help="LoCoMo questions per size")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="locomo-dev.json")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime threads, both sides")
    parser.add_argument("--pooled-spans", choices=("on", "off"), default="on",
                        help="HYATLAS_EMBED_POOLED_SPANS of our stack")
    parser.add_argument("--one-client", type=int, default=200, help="adds timed one at a time")
    parser.add_argument("--batched", type=int, default=2048,
                        help="adds timed with 8 clients when the bulk path seeds the rest")
    parser.add_argument("--import-chunk", type=int, default=2000, help="memories per import")
    parser.add_argument("--floor-texts", type=int, default=2048,
                        help="texts of each size embedded raw as the batched floor")
    parser.add_argument("--measured", type=int, default=4000,
                        help="adds timed at each size (1 client, 8 clients, bulk); the memories "
                        "before them are seeded with the same vectors on both sides (0: all "
                        "embedded and timed)")
    parser.add_argument("--log-level", default="info",
                        help="debug: the search service logs per-stage timings, summarised")
    add_backend_argument(parser)
    parser.add_argument("--store-replicas", type=int, default=1,
                        help="store processes on the one PostgreSQL database, taking calls in "
                        "turn (HYATLAS_STORE_REPLICAS of scripts/run.py)")
    parser.add_argument("--pg-setting", action="append", default=[], metavar="NAME=VALUE",
                        help="a server setting of the throwaway PostgreSQL, such as "
                        "shared_buffers=4GB (repeatable; default: the server as the tests run it)")
    parser.add_argument("--defer-indexes", metavar="MEMORY",
                        help="PostgreSQL: seed with the HNSW indexes deferred, then build them "
                        "with this maintenance_work_mem, such as 8GB (pg/indexes.py)")
    parser.add_argument("--no-peer", action="store_true",
                        help="without chromadb: only this project is grown and timed")
    parser.add_argument("--table", type=Path, nargs="+", metavar="RESULTS",
                        help="print runs' results files side by side as one markdown table "
                        "(e.g. SQLite, PostgreSQL with 1 and 2 stores) and run nothing")
    parser.add_argument("--out", type=Path, default=None,
                        help="default bench/results/compare.json; with another backend, more "
                        "stores or no peer compare_<backend>[_<n>stores][_nopeer].json")
    args = parser.parse_args()
    if args.table:
        print(backends_table([json.loads(path.read_text()) for path in args.table]))
        return 0
    sizes = sorted(int(s) for s in args.sizes.split(","))
    layouts = [int(s) for s in args.owners.split(",")]
    if not args.data.is_file():
        print(f"no LoCoMo data at {args.data} (use --data)", file=sys.stderr)
        return 1
    if args.store_replicas > 1 and args.backend != "postgres":
        print("--store-replicas needs --backend postgres (replicas share its database)",
              file=sys.stderr)
        return 1
    if not args.no_peer and not BENCH_PYTHON.is_file():
        print(f"no {BENCH_PYTHON}: run `make bench-venv`", file=sys.stderr)
        return 1
    turns_by_owner, qs = load(args.data)
    turns = [t.text for rows in turns_by_owner.values() for t in rows]
    parts = memory_parts(turns, sizes[-1])
    texts = [memory_text(turns, part) for part in parts]
    step = max(1, len(qs) // args.queries)
    questions = probes(qs[::step][: args.queries], turns_by_owner)
    started = datetime.now(UTC)
    load_start = os.getloadavg()
    print(f"{len(texts)} texts (mean {statistics.fmean(map(len, texts)):.0f} chars), "
          f"{len(questions)} queries, load {load_start[0]:.2f}", flush=True)
    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-postgres-") as folder,
        throwaway(args.backend, Path(folder), pg_settings(args.pg_setting)) as databases,
    ):
        for owners in layouts:
            seeding = (turns, parts) if args.measured else None
            rows += asyncio.run(
                run_layout(owners, sizes, texts, questions, args, seeding, databases)
            )
    load_end = os.getloadavg()
    report = {
        "started": started.isoformat(timespec="seconds"),
        "minutes": round((datetime.now(UTC) - started).total_seconds() / 60, 1),
        "command": " ".join([".venv/bin/python -m bench.compare", *sys.argv[1:]]),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "backend": args.backend,
        "store_replicas": args.store_replicas,
        "pooled_spans": args.pooled_spans,
        "pg_settings": pg_settings(args.pg_setting),
        "peer": None if args.no_peer else "chromadb",
        "threads": args.threads,
        "texts_mean_chars": round(statistics.fmean(map(len, texts)), 1),
        "queries": len(questions),
        "k": K,
        "load_avg_start": [round(x, 2) for x in load_start],
        "load_avg_end": [round(x, 2) for x in load_end],
        "rows": rows,
    }
    print(f"\n{started:%Y-%m-%d %H:%M} UTC, {report['minutes']} min, load average (1/5/15 min) "
          f"at start {report['load_avg_start']}, at end {report['load_avg_end']}\n")
    print(markdown(rows))
    if stages := stage_lines(rows):
        print(f"\nsearch service, median ms per stage (ranking stages: ms/candidates):\n{stages}")
    out = args.out or RESULTS / f"compare{results_suffix(args)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def pg_settings(given: list[str]) -> dict[str, str]:
    """--pg-setting NAME=VALUE options as a mapping."""
    pairs = [item.partition("=") for item in given]
    if any(not name or not eq for name, eq, _ in pairs):
        raise SystemExit(f"--pg-setting takes NAME=VALUE, not {given!r}")
    return {name.strip(): value.strip() for name, _, value in pairs}


def results_suffix(args: argparse.Namespace) -> str:
    """What sets a run apart from the default one (SQLite beside chromadb) in its file name."""
    if args.backend == "sqlite" and args.store_replicas == 1 and not args.no_peer:
        return ""
    replicas = f"_{args.store_replicas}stores" if args.store_replicas > 1 else ""
    return f"_{args.backend}{replicas}{'_nopeer' if args.no_peer else ''}"


if __name__ == "__main__":
    sys.exit(main())
