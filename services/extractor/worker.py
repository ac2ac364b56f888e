"""When extractions run: on a write (waiting or behind it), on reprocess, and in catch-up runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.extractor.extract import (
    ACTOR,
    Extraction,
    Outcome,
    owner_scope,
)
from services.extractor.living import Living
from services.extractor.owner_locks import OwnerLocks
from shared.errors import Conflict, NotFound
from shared.layers import DONE, EXTRACTION_TRIES, FAILED, PENDING, SKIPPED, UNCONFIGURED
from shared.leases import Leases, lease_name
from shared.llm import LlmClient, LlmUnavailable
from shared.pb import common_pb2, store_pb2
from shared.settings import LLM_MODES
from shared.store_client import PAGE, StoreClient, update_op

log = logging.getLogger(__name__)

REPROCESS_MAX_DEFAULT = 200
SCAN_PAGES = 20
"""How many pages of one state a catch-up run reads at most, passing over rows being extracted
(the store leaves out turns written in lite and turns given up on, which stay failed): 20 pages
of 5 × batch rows, 2,000 at the default batch."""
OWNER_LEASE = "extraction"
"""The lease of an owner's extractions: one at a time, whichever replica runs them."""


def llm_state(mode: str, llm: LlmClient) -> str:
    """unused (lite), unconfigured (no base or model), awaiting_key, or ok."""
    if mode not in LLM_MODES:
        return "unused"
    if not llm.configured:
        return "unconfigured"
    return "ok" if llm.has_key() else "awaiting_key"


_NOT_CONFIGURED = {
    "unconfigured": "no LLM is configured",
    "awaiting_key": "no LLM key yet",
}
"""The LLM states in which a write is stored unconfigured, each with why."""


@dataclass(frozen=True)
class CatchupPolicy:
    """Which raw rows a catch-up run takes, and how many."""

    every_s: float | None = 600.0
    max_age_s: float | None = 168 * 3600.0
    min_age_s: float = 120.0
    batch: int = 20
    tries: int = EXTRACTION_TRIES


@dataclass(frozen=True)
class Counts:
    """What a reprocess or catch-up run did."""

    reprocessed: int = 0
    failed: int = 0
    skipped: int = 0


class Worker:
    """Runs extractions one owner at a time, tracks those in flight, and catches up."""

    def __init__(
        self,
        extraction: Extraction,
        store: StoreClient,
        mode: str,
        policy: CatchupPolicy,
        leases: Leases,
        living: Living | None = None,
    ) -> None:
        self.extraction = extraction
        self.leases = leases
        self.living = living
        self.store = store
        self.mode = mode
        self.policy = policy
        self._locks = OwnerLocks()
        self._tasks: dict[str, asyncio.Task[Outcome]] = {}
        self._wake = asyncio.Event()
        self._catchup_lock = asyncio.Lock()

    # -- state ----------------------------------------------------------------------------

    def llm_state(self) -> str:
        """unused (lite), unconfigured (no base or model), awaiting_key, or ok."""
        return llm_state(self.mode, self.extraction.llm)

    @property
    def in_flight(self) -> int:
        """Extractions running now."""
        return len(self._tasks)

    def key_arrived(self, key: str) -> None:
        """Keeps a posted key and starts a catch-up run; refused while no endpoint is set."""
        if self.llm_state() == "unconfigured":
            # Kept, it would serve no call: the endpoint is read from the environment at start,
            # and a posted key is lost at a restart.
            raise Conflict(
                "no LLM endpoint is configured (HYATLAS_LLM_BASE and HYATLAS_LLM_MODEL): "
                "the key was not kept"
            )
        self.extraction.llm.keys.post(key)
        self.trigger()

    def trigger(self) -> None:
        """Asks the catch-up loop for a run now."""
        self._wake.set()

    # -- one row --------------------------------------------------------------------------

    async def extract(self, scope: common_pb2.Scope, memory_id: str, wait: bool) -> Outcome:
        """Extracts a raw row now (wait) or behind the caller (pending)."""
        raw = await self.store.get(scope, memory_id)
        if raw.layer != common_pb2.L2_RAW:
            return Outcome(SKIPPED, "not a raw row")
        state = self.llm_state()
        if state == "unused":
            return Outcome(SKIPPED)
        if state in _NOT_CONFIGURED:
            # Nothing extracts it until a model (and a key) is set: catch-up takes it then.
            await self.store.apply(
                owner_scope(raw), [update_op(raw.id, extraction_status=UNCONFIGURED)], ACTOR,
                _NOT_CONFIGURED[state],
            )
            return Outcome(UNCONFIGURED)
        task = self._start(raw)
        if not wait:
            return Outcome(PENDING)
        try:
            return await asyncio.shield(task)
        except LlmUnavailable as exc:
            return Outcome(FAILED, exc.message)

    def _start(self, raw: common_pb2.Memory) -> asyncio.Task[Outcome]:
        running = self._tasks.get(raw.id)
        if running is not None:
            return running
        task = asyncio.create_task(self._run(raw), name=f"extract {raw.id}")
        self._tasks[raw.id] = task
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Outcome]) -> None:
        for memory_id, running in list(self._tasks.items()):
            if running is task:
                del self._tasks[memory_id]
        if not task.cancelled():
            task.exception()  # retrieved here: a background failure is already logged

    async def _run(self, chosen: common_pb2.Memory) -> Outcome:
        """One extraction under its owner's lock and lease; a model error leaves the row
        failed."""
        owner = (chosen.owner.user_id, chosen.owner.agent_id)
        lease = self.leases.held(lease_name(OWNER_LEASE, *owner), wait=True)
        async with self._locks.hold(owner), lease:
            # Read only now: another extraction of the owner, here or on another replica, may
            # have changed what it is shown, or extracted this very row, meanwhile.
            try:
                context = await self.extraction.read_context(owner_scope(chosen), chosen.id)
            except NotFound:
                return Outcome(SKIPPED, "the row is gone")
            raw = context.raw
            if chosen.extraction_status != DONE and raw.extraction_status == DONE:
                return Outcome(SKIPPED, "extracted meanwhile")
            try:
                # The Now page request is stored with the extraction's result, in one
                # transaction: no kill between two writes loses it.
                asked = self.living.asked_ops(raw) if self.living is not None else []
                outcome = await self.extraction.extract(context, also=asked)
                if outcome.status == DONE and self.living is not None:
                    stored = bool(asked) and not outcome.also_refused
                    await self.living.after_write(raw, stored=stored)
                return outcome
            except LlmUnavailable as exc:
                log.warning("extraction of %s failed: %s", raw.id, exc.message)
                await self._mark_failed(raw, exc)
                raise
            except Exception as exc:
                log.exception("extraction of %s failed", raw.id)
                return await self._mark_failed(raw, exc)

    async def _mark_failed(self, raw: common_pb2.Memory, exc: Exception) -> Outcome:
        """Marks the row failed; a row deleted meanwhile is skipped, since nothing is left to
        mark and a run of many rows goes on to the next."""
        try:
            await self.extraction.fail(raw, exc)
        except NotFound:
            return Outcome(SKIPPED, "the row is gone")
        return Outcome(FAILED, str(exc))

    async def _extract_one(self, raw: common_pb2.Memory) -> Outcome:
        """Runs (or joins) the extraction of one row; LlmUnavailable propagates."""
        return await asyncio.shield(self._start(raw))

    # -- many rows ------------------------------------------------------------------------

    async def reprocess(self, ids: list[str], most: int) -> Counts:
        """Re-extracts the ids (even if done), or up to most unextracted rows, oldest first."""
        everyone = common_pb2.Scope(all_users=True)
        if self.llm_state() != "ok":
            count = len(ids) if ids else len(await self._unextracted(most or 200, aged=False))
            return Counts(skipped=count)
        if ids:
            rows = []
            skipped = 0
            for memory_id in ids:
                try:
                    rows.append(await self.store.get(everyone, memory_id))
                except NotFound:
                    skipped += 1
        else:
            rows = await self._unextracted(most or REPROCESS_MAX_DEFAULT, aged=False)
            skipped = 0
        counts, untried = await self._extract_in_order(rows)
        return Counts(counts.reprocessed, counts.failed, counts.skipped + skipped + untried)

    async def _extract_in_order(self, rows: list[common_pb2.Memory]) -> tuple[Counts, int]:
        """Extracts rows one at a time until the first model error (a failure); the tally and
        how many rows were never tried."""
        done = failed = skipped = 0
        for i, raw in enumerate(rows):
            try:
                outcome = await self._extract_one(raw)
            except LlmUnavailable:
                return Counts(done, failed + 1, skipped), len(rows) - i - 1
            if outcome.status == DONE:
                done += 1
            elif outcome.status == FAILED:
                failed += 1
            else:
                skipped += 1
        return Counts(done, failed, skipped), 0

    async def _unextracted(self, most: int, *, aged: bool) -> list[common_pb2.Memory]:
        """Live raw rows extraction has not reached, oldest first; catch-up's (aged) takes only
        rows written in a mode that extracts and not given up on, and reads on past rows being
        extracted to find most."""
        now = time.time()
        request = store_pb2.ListMemoriesRequest(
            scope=common_pb2.Scope(all_users=True),
            layers=[common_pb2.L2_RAW],
            order="oldest",
            limit=min(max(most, 1) * 5, PAGE),
        )
        if aged:
            request.created_before = now - self.policy.min_age_s
            if self.policy.max_age_s is not None:
                request.created_after = now - self.policy.max_age_s
            # Left out by the store: thousands given up on, or written in lite, would fill
            # every page read.
            request.tries_below = self.policy.tries
            request.write_modes.extend(LLM_MODES)
        rows: list[common_pb2.Memory] = []
        for status in (PENDING, FAILED, UNCONFIGURED):
            request.extraction_status = status
            rows.extend(await self._first_taken(request, most, self._takes if aged else None))
        rows.sort(key=lambda r: r.created_at)
        return rows[:most]

    def _takes(self, row: common_pb2.Memory) -> bool:
        """Whether catch-up may take a row the store listed (not given up on): not being
        extracted now, and written in a mode that extracts (the store's filter already says so;
        a store older than it lists lite turns too, which must never reach the model)."""
        return row.write_mode in LLM_MODES and row.id not in self._tasks

    async def _first_taken(
        self,
        request: store_pb2.ListMemoriesRequest,
        most: int,
        takes: Callable[[common_pb2.Memory], bool] | None,
    ) -> list[common_pb2.Memory]:
        """Up to most rows of the listing that takes accepts (all, without it), page after page
        by the listing's cursor, reading at most SCAN_PAGES pages (what is left waits for the
        next run)."""
        page = store_pb2.ListMemoriesRequest()
        page.CopyFrom(request)
        kept: list[common_pb2.Memory] = []
        for _ in range(SCAN_PAGES if takes is not None else 1):
            reply = await self.store.list_page(page)
            kept += [r for r in reply.memories if takes is None or takes(r)]
            if len(kept) >= most or len(reply.memories) < page.limit or not reply.next_cursor:
                break
            page.cursor = reply.next_cursor
        return kept[:most]

    async def catch_up(self) -> Counts:
        """One run: up to batch rows, one at a time; stops at the first model error."""
        if self.llm_state() != "ok":
            return Counts()
        async with self._catchup_lock:
            rows = await self._unextracted(self.policy.batch, aged=True)
            counts, untried = await self._extract_in_order(rows)
            if untried:
                log.info("catch-up stops at a model error; %d rows left", untried)
            if rows:
                log.info(
                    "catch-up: %d extracted, %d failed, %d skipped",
                    counts.reprocessed, counts.failed, counts.skipped,
                )
            return counts

    async def run_catchup(self) -> None:
        """Catch-up at start, every `every_s` and whenever triggered, until cancelled."""
        if self.mode not in LLM_MODES or self.policy.every_s is None:
            return
        while True:
            try:
                await self.catch_up()
            except Exception:
                log.exception("catch-up run failed; the next run retries")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.policy.every_s):
                    await self._wake.wait()
            self._wake.clear()

    async def drain(self, grace_s: float) -> None:
        """Waits up to grace_s for extractions in flight; the rest are left to catch-up."""
        tasks = list(self._tasks.values())
        if not tasks:
            return
        log.info("waiting up to %gs for %d extractions in flight", grace_s, len(tasks))
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        for task in pending:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
