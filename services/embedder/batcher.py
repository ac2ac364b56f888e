"""Micro-batching: concurrent embed calls coalesced into model runs, a few at a time."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Generic, TypeVar

import numpy as np

from shared.errors import Overloaded, Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
RunBatch = Callable[[list[T]], Awaitable[np.ndarray]]
OnIdle = Callable[[], Awaitable[None]]


@dataclass(eq=False)
class _Request(Generic[T]):
    texts: Sequence[T]
    future: asyncio.Future[np.ndarray]
    taken: int = 0
    """How many of the texts are in a run already."""
    filled: int = 0
    parts: dict[int, np.ndarray] = field(default_factory=dict)
    """The rows of the texts run so far, by the first text of each run's slice (runs may end
    in another order than they began)."""


# A request, and the range of its texts a run takes.
_Slice = tuple[_Request[T], int, int]

# After a run of writes' or queries' texts, the next this many bulk runs are short: a
# SHORT_BULK_SHARE of a run's texts and padded tokens. An agent writing during an import
# waits for one short run of the import's texts, not a full one (about 0.6 s of 64 memories
# here); once no other text came for that many runs, an import's runs are full again.
SHORT_BULK_RUNS = 8
SHORT_BULK_SHARE = 4
# While bulk texts wait, a bulk run comes after at most this many runs of others (queries go
# first all the same): writers that never pause cannot hold an import back past its deadline.
OTHER_RUNS_PER_BULK = 1
# How long the batcher waits without a call after a run before it calls its idle hook.
IDLE_S = 1.0


class MicroBatcher(Generic[T]):
    """Queues texts from concurrent callers; `runs` workers each run whatever queued up, in
    order, one run at a time (so at most `runs` runs are in flight).

    While runs are in flight, new calls wait in the queue; the next run takes all of them, up
    to max_batch texts, and (given tokens_of) up to max_tokens padded tokens: its texts x the
    most tokens one of them takes, at least one text. A call with more texts than a run takes
    spans several runs. A call that would take the queue past max_queue vectors to make is
    refused (Overloaded) unless the queue is empty.

    Urgent calls (a search's query) wait in a queue of their own, which the next run takes
    alone: a query waits for a run in flight to end, not for the writes queued before it too. Bulk
    calls (an import's batches) wait in a third, run when the other two are empty or when their
    turn comes while others keep coming (OTHER_RUNS_PER_BULK), and are counted against max_queue
    among themselves: a write is never refused for an import's texts, and waits for one run of
    them at most, a short one while others keep coming (see SHORT_BULK_RUNS). A bulk call that
    would take its queue past max_queue waits for room (its caller's deadline bounds the wait)
    instead of being refused.

    When no call came for idle_s after a run and no run is in flight, a worker awaits on_idle
    (if given), once: the backend may give back what its runs held. An import's next batch,
    sent the moment the one before is embedded, comes well within it.
    """

    def __init__(
        self,
        run_batch: RunBatch[T],
        max_batch: int,
        rows_of: Callable[[T], int] = lambda _: 1,
        max_queue: int = 256,
        tokens_of: Callable[[T], int] | None = None,
        max_tokens: int = 0,
        on_idle: OnIdle | None = None,
        idle_s: float = IDLE_S,
        runs: int = 1,
    ) -> None:
        """rows_of: how many rows run_batch gives for one item (one, for a plain text);
        tokens_of: about how many tokens the model takes of one item (so that the run a query
        waits for is short however long the texts written are); runs: how many runs may be
        in flight at once (each on a worker of its own)."""
        self._run_batch = run_batch
        self._on_idle = on_idle
        self._idle_s = idle_s
        self._ran_since_idle = False
        self._rows_of = rows_of
        self._tokens_of = tokens_of
        self._max_tokens = max_tokens
        self._max_batch = max(1, max_batch)
        self._max_queue = max(1, max_queue)
        self._queue: collections.deque[_Request[T]] = collections.deque()
        self._urgent: collections.deque[_Request[T]] = collections.deque()
        self._bulk: collections.deque[_Request[T]] = collections.deque()
        self._bulk_room = asyncio.Condition()
        self._bulk_runs_since_other = SHORT_BULK_RUNS
        self._other_runs_since_bulk = 0
        self._wakeup = asyncio.Event()
        self._runs = max(1, runs)
        self._in_flight = 0
        self._workers: list[asyncio.Task[None]] = []
        self._closed = False
        self.runs = 0
        """Model runs so far (for logs and benchmarks)."""
        self.texts_run = 0
        """Vectors made so far (a text with spans makes one for each span too)."""

    @property
    def waiting_calls(self) -> int:
        """Calls queued and not yet wholly taken into a run."""
        return len(self._queue) + len(self._urgent) + len(self._bulk)

    @property
    def waiting_vectors(self) -> int:
        """Vectors still to make for the texts queued and not yet taken into a run."""
        return self._waiting(self._urgent, self._queue, self._bulk)

    def _waiting(self, *queues: collections.deque[_Request[T]]) -> int:
        return sum(
            self._rows_of(text)
            for queue in queues
            for request in queue
            for text in request.texts[request.taken :]
        )

    async def __aenter__(self) -> MicroBatcher[T]:
        self._workers = [
            asyncio.create_task(self._work(), name=f"embed-batcher-{n}") for n in range(self._runs)
        ]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stops the workers; calls still queued fail as Unavailable. Closing twice is harmless."""
        if not self._closed:
            log.info("batcher embedded %d texts in %d runs", self.texts_run, self.runs)
        self._closed = True
        async with self._bulk_room:
            self._bulk_room.notify_all()
        for worker in self._workers:
            worker.cancel()
        for worker in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        self._workers = []
        for queue in (self._urgent, self._queue, self._bulk):
            while queue:
                request = queue.popleft()
                if not request.future.done():
                    request.future.set_exception(Unavailable("embedder is stopping"))

    async def embed(
        self, texts: Sequence[T], *, urgent: bool = False, bulk: bool = False
    ) -> np.ndarray:
        """The rows run_batch gives for texts, in order, computed in a shared run (with other
        urgent calls only, when urgent; with other bulk calls only, when bulk)."""
        rows = sum(self._rows_of(text) for text in texts)
        if bulk:
            await self._room_for_bulk(rows)
        if self._closed or not self._workers:
            raise Unavailable("embedder is not running")
        waiting = self._waiting(self._urgent, self._queue)
        if not bulk and not self._fits(waiting, rows):
            raise Overloaded(
                f"embedder queue is full ({waiting} vectors waiting, limit {self._max_queue})"
            )
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        queue = self._bulk if bulk else self._urgent if urgent else self._queue
        queue.append(_Request(texts, future))
        self._wakeup.set()
        return await future

    def _fits(self, waiting: int, rows: int) -> bool:
        # An empty queue takes a call of any size, so a long call is slow, never refused.
        return not waiting or waiting + rows <= self._max_queue

    async def _room_for_bulk(self, rows: int) -> None:
        """Waits till the bulk queue has room for rows more vectors (or the batcher closes)."""
        async with self._bulk_room:
            await self._bulk_room.wait_for(
                lambda: self._closed or self._fits(self._waiting(self._bulk), rows)
            )

    def _take(self) -> list[_Slice[T]]:
        """Slices of queued requests that fill one run (see the class): the urgent ones if any
        wait, else the bulk ones when their turn came (OTHER_RUNS_PER_BULK), else the others,
        else the bulk ones, in arrival order."""
        others = self._take_from(self._urgent)
        if not others:
            if self._other_runs_since_bulk >= OTHER_RUNS_PER_BULK and (bulk := self._take_bulk()):
                return bulk
            others = self._take_from(self._queue)
        if not others:
            return self._take_bulk()
        self._bulk_runs_since_other = 0
        self._other_runs_since_bulk += 1
        return others

    def _take_bulk(self) -> list[_Slice[T]]:
        """One bulk run's slices: a short run while others came of late (SHORT_BULK_RUNS)."""
        short = self._bulk_runs_since_other < SHORT_BULK_RUNS
        slices = self._take_from(self._bulk, SHORT_BULK_SHARE if short else 1)
        if slices:
            self._bulk_runs_since_other += 1
            self._other_runs_since_bulk = 0
        return slices

    def _take_from(self, queue: collections.deque[_Request[T]], share: int = 1) -> list[_Slice[T]]:
        """The slices of one run from queue, of at most a share-th of a run's texts and tokens."""
        slices: list[_Slice[T]] = []
        most = max(1, self._max_batch // share)
        room = most
        longest = 0
        while queue and room > 0:
            request = queue[0]
            if request.future.done():  # the caller gave up (deadline, cancel)
                queue.popleft()
                continue
            start = request.taken
            fits, longest = self._fit(
                request.texts[start : start + room], most - room, longest, share
            )
            if not fits:
                break
            end = start + fits
            slices.append((request, start, end))
            request.taken = end
            room -= end - start
            if end == len(request.texts):
                queue.popleft()
        return slices

    def _fit(self, texts: Sequence[T], taken: int, longest: int, share: int) -> tuple[int, int]:
        """How many of texts a run holding `taken` texts of up to `longest` tokens takes before
        its padded tokens would pass a share-th of max_tokens (a first text always), and its
        longest then."""
        if self._tokens_of is None:
            return len(texts), longest
        budget = self._max_tokens // share
        for count, text in enumerate(texts):
            tokens = max(longest, self._tokens_of(text))
            if taken + count and (taken + count + 1) * tokens > budget:
                return count, longest
            longest = tokens
        return len(texts), longest

    async def _work(self) -> None:
        while True:
            await self._next_call()
            slices = self._take()
            if not self._queue and not self._urgent and not self._bulk:
                self._wakeup.clear()
            async with self._bulk_room:  # bulk texts taken (or given up) make room for others
                self._bulk_room.notify_all()
            if not slices:
                continue
            texts = [text for request, start, end in slices for text in request.texts[start:end]]
            self._in_flight += 1
            try:
                vectors = await self._run_batch(texts)
            except asyncio.CancelledError:
                for request, _, _ in slices:
                    if not request.future.done():
                        request.future.set_exception(Unavailable("embedder is stopping"))
                raise
            except Exception as exc:
                log.warning("embedding run of %d texts failed: %s", len(texts), exc)
                for request, _, _ in slices:
                    if not request.future.done():
                        request.future.set_exception(exc)
                continue
            finally:
                self._in_flight -= 1
            self.runs += 1
            self.texts_run += sum(self._rows_of(item) for item in texts)
            self._hand_out(slices, vectors)
            self._ran_since_idle = True

    async def _next_call(self) -> None:
        """Waits for a call. After runs, if none comes within idle_s and no other worker's run
        is in flight, the idle hook runs first (once: the next wait for a call is plain)."""
        if self._wakeup.is_set() or self._on_idle is None or not self._ran_since_idle:
            await self._wakeup.wait()
            return
        try:
            await asyncio.wait_for(self._wakeup.wait(), self._idle_s)
            return
        except TimeoutError:
            # Not while another worker's run is in flight (that worker waits idle_s in turn
            # once it ends), nor when another worker took the hook meanwhile.
            if self._in_flight or not self._ran_since_idle:
                await self._wakeup.wait()
                return
            self._ran_since_idle = False
        try:
            await self._on_idle()
        except Exception as exc:  # the hook only tidies up: the next run goes ahead
            log.warning("embedder idle hook failed: %s", exc)
        await self._wakeup.wait()

    def _hand_out(self, slices: list[_Slice[T]], vectors: np.ndarray) -> None:
        """Gives each request its part of a run's vectors, completing those now whole."""
        offset = 0
        for request, start, end in slices:
            rows = sum(self._rows_of(item) for item in request.texts[start:end])
            part = vectors[offset : offset + rows]
            offset += rows
            if request.future.done():
                continue
            request.parts[start] = part
            request.filled += end - start
            if request.filled == len(request.texts):
                parts = [request.parts[at] for at in sorted(request.parts)]
                whole = parts[0] if len(parts) == 1 else np.vstack(parts)
                request.future.set_result(whole)
