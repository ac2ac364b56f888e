"""Which clusters a pass runs: due ones within a time budget, none after repeated failures."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from services.consolidator.clusters import Cluster, median
from services.consolidator.config import ConsolidatorConfig
from services.consolidator.survey import ACTOR, STATE, Owner, cluster_key
from shared.pb import common_pb2, store_pb2
from shared.store_client import GraphStoreClient, state_op

if TYPE_CHECKING:
    from services.consolidator.passes import Report

DURATIONS_KEY = f"{STATE}durations"
DURATIONS_KEPT = 20
SKIP_AFTER_FAILS = 3
SKIP_S = 24 * 3600.0

Job = tuple[Owner, Cluster]
RunCluster = Callable[[Owner, Cluster], Awaitable[bool]]


def due_jobs(report: Report, owners: Sequence[Owner], now: float) -> deque[Job]:
    """The due clusters not skipped, owner by owner; the report counts the rest."""
    jobs: deque[Job] = deque()
    for owner in owners:
        due = [c for c in owner.clusters if c.due()]
        active = [c for c in due if not c.skipped(now)]
        for cluster in due:
            if cluster.skipped(now):
                until = datetime.fromtimestamp(cluster.skip_until, UTC).isoformat()
                report.errors.append(
                    f"cluster {owner.id}#{cluster.id} skipped after {SKIP_AFTER_FAILS} "
                    f"failed passes until {until} or until its facts change"
                )
        if not due:
            report.owners_unchanged += 1
        elif not active:
            report.skipped_owners.append(owner.id)
        else:
            report.owners_run += 1
            jobs.extend((owner, c) for c in active)
    return jobs


async def run_jobs(
    store: GraphStoreClient,
    config: ConsolidatorConfig,
    report: Report,
    jobs: deque[Job],
    started: float,
    run: RunCluster,
) -> None:
    """Runs jobs while the budget leaves time for one more call, then charges the failures."""
    state = await store.state(DURATIONS_KEY)
    durations: list[float] = json.loads(state.get(DURATIONS_KEY, "[]"))
    estimate = max(config.min_call_estimate_s, 1.25 * median(durations))
    failed: list[Job] = []
    succeeded = 0
    calls_failed_before = report.failed_calls

    async def worker() -> None:
        nonlocal succeeded
        while jobs:
            left = config.budget_s - (time.monotonic() - started)
            if left < estimate:
                return
            owner, cluster = jobs.popleft()
            report.clusters_run += 1
            began = time.monotonic()
            if await run(owner, cluster):
                succeeded += 1
                durations.append(time.monotonic() - began)
            else:
                failed.append((owner, cluster))

    await _together([worker() for _ in range(config.parallel)])
    report.clusters_pending = len(jobs) + len(failed)
    ops = [state_op(DURATIONS_KEY, durations[-DURATIONS_KEPT:])] if succeeded else []
    # Calls that failed, not clusters: one whose ops the store refused (a fact forgotten
    # meanwhile) had its answer, and says nothing of the provider.
    calls_failed = report.failed_calls - calls_failed_before
    if calls_failed >= 2 and succeeded == 0 and calls_failed == len(failed):
        report.provider_down = True
        report.errors.append(
            f"all {calls_failed} calls failed: the provider is taken to be down and no "
            "cluster is charged"
        )
    else:
        ops += _charged(report, failed, time.time())
    if ops:
        await store.apply(common_pb2.Scope(all_users=True), ops, ACTOR, "pass schedule")


async def _together(workers: Sequence[Coroutine[Any, Any, None]]) -> None:
    """Runs the workers at once; when one fails (or this is cancelled) the others are
    cancelled and awaited before the error goes up, so none outlives the pass's lock."""
    tasks = [asyncio.create_task(w) for w in workers]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _charged(report: Report, failed: Sequence[Job], now: float) -> list[store_pb2.Op]:
    """Counts a failure against each cluster; the third in a row skips it for a day."""
    ops: list[store_pb2.Op] = []
    for owner, cluster in failed:
        cluster.fails += 1
        if cluster.fails >= SKIP_AFTER_FAILS:
            cluster.skip_until = now + SKIP_S
            cluster.skip_hash = cluster.hash
            report.clusters_pending -= 1
            report.errors.append(
                f"cluster {owner.id}#{cluster.id} failed {cluster.fails} passes in a "
                "row: skipped for 24h or until its facts change"
            )
        ops.append(state_op(cluster_key(owner.id, cluster.id), cluster.to_json()))
    return ops
