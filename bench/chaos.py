"""Chaos: kill -9 of each service in turn under four concurrent writers (supervisord restarts
it, as under `make run`), then a burst of 200 adds at once; acknowledged writes versus found.

A writer sends each add with an Idempotency-Key and, when it fails, sends it again with the same
key until it is acknowledged, as a careful client would; a first try that was stored although
its answer was lost is then answered as a replay, and no text may be stored twice."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.support import ROOT, free_port

log = logging.getLogger("chaos")

RESULTS = Path(__file__).resolve().parent / "results"
SERVICES = ("store", "gateway", "embedder", "search")
"""What lite mode runs (shared.settings.MODE_SERVICES, and the gateway)."""
WRITERS = 4
KILL_AT = 0.35
"""The share of a phase's writes sent before the kill."""
FAILED_PAUSE_S = 0.05
"""A writer's pause after a failed write, so an outage is sampled rather than flooded."""
PHASE_CEILING_S = 180.0
BURST = 200
BURST_TEXT = "The quarterly review covered the garden project, the new roof and the budget. " * 16


@dataclass
class Attempt:
    """One add as its client saw it."""

    text: str
    status: int
    """HTTP status, or 0 when no answer came (connection refused or reset)."""
    memory_id: str
    took_s: float
    error: str = ""
    """Why no answer or body came (an exception's name)."""
    replayed: bool = False
    retry_after_s: float = 1.0


@dataclass
class Phase:
    """One service killed under load, and what the clients and the store saw."""

    service: str
    acked: int = 0
    found: int = 0
    lost: int = 0
    ghosts: int = 0
    """Rows no acknowledged write accounts for."""
    doubles: int = 0
    """Texts stored more than once."""
    replayed: int = 0
    """Acknowledgements that were replays: a lost answer of a stored write."""
    unavailable_503: int = 0
    no_answer: int = 0
    other: int = 0
    outage_s: float = 0.0
    slowest_s: float = 0.0
    errors: list[str] = field(default_factory=list)


class Supervised:
    """Every service under supervisord through scripts/run.py, on a fresh data directory."""

    def __init__(self, data_dir: Path, settings: dict[str, str]) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HYATLAS_")}
        self.env.update(
            HYATLAS_GO_DATA=str(data_dir), HYATLAS_GO_PORT=str(self.port), HYATLAS_MODE="lite",
            HYATLAS_SNAPSHOT_EVERY="off", PYTHONUNBUFFERED="1", **settings,
        )
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Starts supervisord with every service (its output goes to run.log)."""
        with (self.data_dir / "run.log").open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "scripts" / "run.py")], cwd=ROOT, env=self.env,
                stdout=out, stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        """SIGTERM to run.py, which stops supervisord and every service."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def pid(self, service: str) -> int:
        """The service's process id, as supervisord reports it (its first process: the store is
        a group of HYATLAS_STORE_REPLICAS processes, store:store-0 and on)."""
        names = [line.split()[0] for line in self._supervisorctl("status").splitlines() if line]
        name = next((n for n in names if n.split(":")[0] == service), service)
        reply = self._supervisorctl("pid", name).strip()
        if not reply.isdigit() or int(reply) <= 0:
            raise RuntimeError(f"supervisord reports no pid for {name}: {reply!r}")
        return int(reply)

    def _supervisorctl(self, *args: str) -> str:
        env = {**self.env, "HYATLAS_SUPERVISOR_DIR": str(self.data_dir / "run" / "supervisor")}
        done = subprocess.run(
            [str(Path(sys.executable).parent / "supervisorctl"), "-c",
             str(ROOT / "deploy" / "supervisord.conf"), *args],
            env=env, capture_output=True, text=True, check=False,
        )
        return done.stdout

    async def ready(self, session: aiohttp.ClientSession) -> bool:
        """Whether /readyz says every service answers."""
        try:
            async with session.get(self.base_url + "/readyz") as reply:
                return bool((await reply.json()).get("ready"))
        except (aiohttp.ClientError, ValueError):
            return False

    async def wait_ready(self, session: aiohttp.ClientSession, ceiling_s: float = 300.0) -> float:
        """Polls /readyz until it says ready; returns how long that took."""
        start = time.monotonic()
        while not await self.ready(session):
            if time.monotonic() - start > ceiling_s:
                raise TimeoutError(f"not ready in {ceiling_s}s; see {self.data_dir / 'run.log'}")
            await asyncio.sleep(0.1)
        return time.monotonic() - start


@asynccontextmanager
async def supervised(data_dir: Path, settings: dict[str, str]) -> AsyncIterator[Supervised]:
    """A started stack, stopped afterwards whatever happens."""
    stack = Supervised(data_dir, settings)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


async def add(
    session: aiohttp.ClientSession, base_url: str, user: str, text: str, key: str = ""
) -> Attempt:
    """One add, never raising: a failure is an attempt with its status (0: no answer)."""
    start = time.monotonic()
    status, memory_id, error, replayed, retry_after_s = 0, "", "", False, 1.0
    headers = {"Idempotency-Key": key} if key else {}
    try:
        async with session.post(
            base_url + "/api/v1/add", json={"text": text, "user_id": user}, headers=headers
        ) as reply:
            status = reply.status
            retry_after_s = float(reply.headers.get("Retry-After", 1))
            body = await reply.json(content_type=None)
            if status == 200:
                memory_id, replayed = body["memory_id"], bool(body.get("replayed"))
            else:
                error = str(body.get("error", ""))[:60]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        error = type(exc).__name__
    return Attempt(
        text, status, memory_id, time.monotonic() - start, error, replayed, retry_after_s
    )


async def stored(
    session: aiohttp.ClientSession, base_url: str, user: str
) -> list[tuple[str, str]]:
    """Every row of the user: (text, id)."""
    rows: list[tuple[str, str]] = []
    while True:
        body = {"user_id": user, "limit": 1000, "offset": len(rows)}
        async with session.post(base_url + "/api/v1/list", json=body) as reply:
            page = await reply.json()
            assert reply.status == 200, page
        rows += [(m["content"], m["memory_id"]) for m in page["memories"]]
        if not page["memories"] or len(rows) >= page["total"]:
            return rows


def tally(phase: Phase, attempts: list[Attempt], rows: list[tuple[str, str]]) -> None:
    """Fills a phase's counts from what the clients saw and what the store holds."""
    acked = {a.text: a.memory_id for a in attempts if a.status == 200}
    found = set(rows)
    phase.acked = len(acked)
    phase.found = sum((text, memory_id) in found for text, memory_id in acked.items())
    phase.lost = phase.acked - phase.found
    phase.ghosts = sum(acked.get(text) != memory_id for text, memory_id in rows)
    phase.doubles = sum(n > 1 for n in Counter(text for text, _ in rows).values())
    phase.replayed = sum(a.replayed for a in attempts)
    phase.unavailable_503 = sum(a.status == 503 for a in attempts)
    phase.no_answer = sum(a.status == 0 for a in attempts)
    phase.other = sum(a.status not in (0, 200, 503) for a in attempts)
    phase.slowest_s = round(max(a.took_s for a in attempts), 2)
    phase.errors = sorted({a.error for a in attempts if a.error})


async def kill_phase(stack: Supervised, service: str, writes: int) -> Phase:
    """Four writers send `writes` adds (and go on until the stack is back); at KILL_AT of them
    the service gets SIGKILL."""
    phase, user = Phase(service), f"chaos-{service}"
    numbers = itertools.count()
    attempts: list[Attempt] = []
    back = asyncio.Event()
    killed_at: list[float] = []
    watchers: list[asyncio.Task[None]] = []
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def writer() -> None:
            deadline = time.monotonic() + PHASE_CEILING_S
            while time.monotonic() < deadline:
                n = next(numbers)
                if n >= writes and back.is_set():
                    return
                if n == int(writes * KILL_AT):
                    pid = await asyncio.to_thread(stack.pid, service)
                    os.kill(pid, signal.SIGKILL)
                    killed_at.append(time.monotonic())
                    log.info("%s (pid %d) killed after %d writes", service, pid, n)
                    watchers.append(asyncio.create_task(watch_outage()))
                key, text = uuid.uuid4().hex, f"chaos {service} {n}"
                while time.monotonic() < deadline:
                    attempt = await add(session, stack.base_url, user, text, key)
                    attempts.append(attempt)
                    if attempt.status == 200:
                        break
                    await asyncio.sleep(FAILED_PAUSE_S)

        async def watch_outage() -> None:
            # The service is gone at once; supervisord notices and starts it again.
            await stack.wait_ready(session)
            phase.outage_s = round(time.monotonic() - killed_at[0], 2)
            back.set()

        await asyncio.gather(*(writer() for _ in range(WRITERS)))
        await asyncio.gather(*watchers)
        tally(phase, attempts, await stored(session, stack.base_url, user))
    log.info("%s: %s", service, phase)
    return phase


async def burst(stack: Supervised) -> dict[str, Any]:
    """BURST adds at once (texts of 1.2 KB) against the default in-flight limit: what the first
    tries got, and how long until every add was stored when each client honours Retry-After and
    sends its add again with the same Idempotency-Key."""
    user = "chaos-burst"
    texts = [f"{i}: {BURST_TEXT}" for i in range(BURST)]
    keys = [uuid.uuid4().hex for _ in texts]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        start = time.monotonic()
        first = await asyncio.gather(
            *(add(session, stack.base_url, user, t, k) for t, k in zip(texts, keys, strict=True))
        )
        retried = await asyncio.gather(
            *(until_stored(session, stack.base_url, user, a, k)
              for a, k in zip(first, keys, strict=True))
        )
        all_stored_s = time.monotonic() - start
        rows = await stored(session, stack.base_url, user)
    phase = Phase("burst")
    tally(phase, [a for tries in retried for a in tries], rows)
    times = [a.took_s for a in first]
    return {
        "errors": Counter(a.error for a in first if a.error).most_common(5),
        "ok_200": sum(a.status == 200 for a in first),
        "busy_503": sum(a.status == 503 for a in first),
        "other": sum(a.status not in (200, 503) for a in first),
        "p50_s": round(statistics.median(times), 2),
        "max_s": round(max(times), 2),
        "all_stored_s": round(all_stored_s, 1),
        "tries": sum(len(tries) for tries in retried),
        "found": phase.found,
        "ghosts": phase.ghosts,
        "stored_twice": phase.doubles,
    }


async def until_stored(
    session: aiohttp.ClientSession, base_url: str, user: str, first: Attempt, key: str
) -> list[Attempt]:
    """Every try of one add: the first, then one a Retry-After later until it is stored."""
    tries = [first]
    deadline = time.monotonic() + PHASE_CEILING_S
    while tries[-1].status != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"an add was not stored in {PHASE_CEILING_S}s: {tries[-1]}")
        await asyncio.sleep(tries[-1].retry_after_s)
        tries.append(await add(session, base_url, user, first.text, key))
    return tries


def table(phases: list[Phase]) -> str:
    """The README's table."""
    lines = [
        "| killed | acked | found | lost | ghosts | stored twice | replayed | 503s | no answer "
        "| outage | slowest |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in phases:
        lines.append(
            f"| {p.service} | {p.acked} | {p.found} | {p.lost} | {p.ghosts} | {p.doubles} | "
            f"{p.replayed} | {p.unavailable_503} | {p.no_answer} | {p.outage_s} s | "
            f"{p.slowest_s} s |"
        )
    return "\n".join(lines)


async def run(writes: int, services: list[str], settings: dict[str, str]) -> dict[str, Any]:
    """Every phase on one supervised stack, then the burst."""
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="hyatlas-chaos-") as tmp:
        async with supervised(Path(tmp), settings) as stack:
            async with aiohttp.ClientSession() as session:
                log.info("stack ready in %.1fs", await stack.wait_ready(session))
            phases = [await kill_phase(stack, service, writes) for service in services]
            log.info("burst of %d adds", BURST)
            burst_result = await burst(stack)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "writes_per_phase": writes,
        "settings": settings,
        "writers": WRITERS,
        "phases": [asdict(p) for p in phases],
        "burst": burst_result,
    }


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--writes", type=int, default=300, help="adds per killed service")
    parser.add_argument("--services", default=",".join(SERVICES),
                        help="services to kill, in order (empty: the burst only)")
    parser.add_argument("--set", action="append", default=[], metavar="HYATLAS_X=VALUE",
                        help="a setting for the stack (lite mode otherwise on defaults)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # SIGTERM stops the run like Ctrl-C, so the supervised stack is stopped too.
    signal.signal(signal.SIGTERM, _interrupted)
    settings = dict(item.split("=", 1) for item in args.set)
    services = [name for name in args.services.split(",") if name]
    result = asyncio.run(run(args.writes, services, settings))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['date']}, load {result['load_before']} -> {result['load_after']}")
    print(table([Phase(**p) for p in result["phases"]]))
    b = result["burst"]
    print(f"burst of {BURST}: {b['ok_200']} x 200, {b['busy_503']} x 503, {b['other']} other; "
          f"p50 {b['p50_s']} s, max {b['max_s']} s; every add stored after {b['all_stored_s']} s "
          f"and {b['tries']} tries: found {b['found']}, ghosts {b['ghosts']}, "
          f"stored twice {b['stored_twice']}")


if __name__ == "__main__":
    main()
