"""One consolidation pass: clusters per owner, calls within a budget, checked ops applied."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from services.consolidator.cluster_pass import run_cluster
from services.consolidator.config import ConsolidatorConfig
from services.consolidator.cross_topic import cross_topic
from services.consolidator.retention import retain_raw
from services.consolidator.schedule import due_jobs, run_jobs
from services.consolidator.survey import Owner, survey
from services.consolidator.undo import revert_pass
from services.consolidator.vectors import Embedder, Vectors
from shared.leases import LeaseBusy, Leases
from shared.llm import LlmClient
from shared.pb import store_pb2
from shared.store_client import GraphStoreClient

log = logging.getLogger(__name__)


def new_pass_id() -> str:
    """A pass id that sorts by time."""
    return "p" + datetime.now(UTC).strftime("%Y%m%d%H%M%S") + uuid.uuid4().hex[:8]


PASS_LEASE = "consolidation"
"""The one lease of passes, surveys and reverts: replicas of the consolidator take turns."""

Busy = LeaseBusy
"""Another pass is already running (in this process or another replica)."""


@dataclass
class Report:
    """What one pass did: the reference's report fields and a few of ours."""

    pass_id: str = ""
    started_at: float = 0.0
    facts_in: int = 0
    owners_run: int = 0
    owners_unchanged: int = 0
    skipped_owners: list[str] = field(default_factory=list)
    clusters_run: int = 0
    clusters_pending: int = 0
    merged: int = 0
    edges: int = 0
    dropped: int = 0
    schemas: int = 0
    cross_schemas: int = 0
    arc: bool = False
    pruned_raw: int = 0
    protected_raw: int = 0
    duration_ms: int = 0
    errors: list[str] = field(default_factory=list)
    dropped_ops: int = 0
    llm_calls: int = 0
    failed_calls: int = 0
    provider_down: bool = False


class Consolidator:
    """Runs passes one at a time and remembers the last one's report."""

    def __init__(
        self,
        config: ConsolidatorConfig,
        store: GraphStoreClient,
        embedder: Embedder,
        llm: LlmClient,
        canonical_user: Callable[[str], str],
        leases: Leases,
    ) -> None:
        self.config = config
        self.store = store
        self.embedder = embedder
        self.llm = llm
        self.canonical_user = canonical_user
        self.runs = 0
        self.last: Report | None = None
        self.last_at = 0.0
        self._lock = asyncio.Lock()
        self._running_pass: asyncio.Task[Report] | None = None
        self._leases = leases
        self._vectors = Vectors(embedder)

    @property
    def running(self) -> bool:
        """Whether a pass is running now in this process."""
        return self._lock.locked()

    @contextlib.asynccontextmanager
    async def _turn(self, *, wait: bool) -> AsyncIterator[None]:
        """This process's lock, then the lease every replica takes: Busy without wait while
        either is held."""
        if not wait and self._lock.locked():
            raise Busy("a consolidation pass is already running")
        async with self._lock, self._leases.held(PASS_LEASE, wait=wait):
            yield

    async def _survey(self, now: float) -> list[Owner]:
        return await survey(self.store, self._vectors, self.config, self.canonical_user, now)

    async def pending(self) -> int:
        """How many clusters are due now (used at start to decide on a catch-up pass)."""
        now = time.time()
        async with self._turn(wait=False):
            owners = await self._survey(now)
        return sum(1 for o in owners for c in o.clusters if c.due() and not c.skipped(now))

    async def run_pass(self) -> Report:
        """Runs one pass now; Busy if one is already running here or on another replica. A
        caller that stops waiting (its deadline passed) does not cut the pass short: its report
        is the last one all the same."""
        if self._running_pass is not None and not self._running_pass.done():
            # Checked before a task is made: the one running stays the one stop() cuts short.
            raise Busy("a consolidation pass is already running")
        self._running_pass = asyncio.create_task(self._run_pass(), name="consolidation pass")
        return await asyncio.shield(self._running_pass)

    async def stop(self) -> None:
        """Cuts a pass in progress short (the service is stopping): what it applied stays,
        its unfinished clusters stay due."""
        if self._running_pass is not None:
            self._running_pass.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._running_pass

    async def _run_pass(self) -> Report:
        async with self._turn(wait=False):
            report = await self._pass()
            self.runs += 1
            self.last = report
            self.last_at = time.time()
            log.info(
                "pass %s: %d clusters run, %d pending, %d merged, %d dropped, %d schemas, "
                "%d edges, %d errors",
                report.pass_id,
                report.clusters_run,
                report.clusters_pending,
                report.merged,
                report.dropped,
                report.schemas,
                report.edges,
                len(report.errors),
            )
            return report

    async def _pass(self) -> Report:
        started = time.monotonic()
        now = time.time()
        report = Report(pass_id=new_pass_id(), started_at=now)
        owners = await self._survey(now)
        report.facts_in = sum(len(o.facts) for o in owners)
        jobs = due_jobs(report, owners, now)
        if jobs and not (self.llm.configured and self.llm.has_key()):
            report.errors.append("the LLM is not configured: no cluster was sent")
            report.clusters_pending = len(jobs)
        elif jobs:
            run = functools.partial(
                run_cluster, self.store, self.llm, self._vectors, self.config.graph, report
            )
            await run_jobs(self.store, self.config, report, jobs, started, run)
        await cross_topic(
            self.store,
            self.llm,
            self._vectors,
            self.config.cross_schema_every_s,
            report,
            owners,
            now,
        )
        await retain_raw(self.store, self.config.raw_retention_s, report)
        report.duration_ms = int((time.monotonic() - started) * 1000)
        return report

    async def revert(self, pass_id: str, actor: str) -> store_pb2.UndoPassResponse:
        """Reverts a pass; its clusters get their old members back and are not due again."""
        async with self._turn(wait=True):
            return await revert_pass(self.store, pass_id, actor)
