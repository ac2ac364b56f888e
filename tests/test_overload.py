"""Bounded work: the gateway's in-flight limit, deadlines that end in 503, the embedder's queue."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from services.embedder.batcher import OTHER_RUNS_PER_BULK, SHORT_BULK_RUNS, MicroBatcher
from services.store.repo import Repo
from shared.errors import Overloaded
from tests.llm_fake import HANG, fake_llm_in_thread
from tests.support import Stack, assert_eventually, running_stack

pytestmark = pytest.mark.slow

BURST = 200
LIMIT = 4


class Reply:
    """What one request got back."""

    def __init__(self, status: int, headers: Any, body: dict[str, Any]) -> None:
        self.status = status
        self.retry_after = headers.get("Retry-After")
        self.body = body


async def post(
    session: aiohttp.ClientSession, stack: Stack, path: str, body: dict[str, Any]
) -> Reply:
    async with session.post(stack.base_url + path, json=body) as reply:
        return Reply(reply.status, reply.headers, await reply.json())


async def stored(stack: Stack, user: str) -> dict[str, str]:
    """Every row the user has: text -> id."""
    async with aiohttp.ClientSession() as session:
        reply = await post(session, stack, "/api/v1/list", {"user_id": user, "limit": 1000})
    assert reply.status == 200, reply.body
    return {m["content"]: m["memory_id"] for m in reply.body["memories"]}


@contextlib.contextmanager
def paused(stack: Stack, service: str) -> Iterator[None]:
    """The service's process stopped (SIGSTOP) for the block: alive, holding its socket, silent."""
    proc = stack.procs[service].proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    """store + gateway with room for LIMIT requests and no queue; a write waits long for the
    store, so only the limit decides who gets 503."""
    with running_stack(
        tmp_path_factory.mktemp("overload"), ["store", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_MAX_IN_FLIGHT=str(LIMIT),
        HYATLAS_QUEUE_WAIT="0",
        HYATLAS_WRITE_DEADLINE="10m",
    ) as s:
        yield s


def burst(user: str) -> list[dict[str, Any]]:
    return [{"text": f"burst note {i} of {user}", "user_id": user} for i in range(BURST)]


def check_replies(bodies: list[dict[str, Any]], replies: list[Reply], rows: dict[str, str]) -> None:
    """Every reply is 200 or a 503 with Retry-After; every 200's row is stored, no 503's is."""
    for body, reply in zip(bodies, replies, strict=True):
        assert reply.status in (200, 503), reply.body
        if reply.status == 200:
            assert rows.get(body["text"]) == reply.body["memory_id"]
        else:
            assert reply.retry_after == "1" and "busy" in reply.body["error"], reply.body
            assert body["text"] not in rows
    assert len(rows) == sum(reply.status == 200 for reply in replies)


async def test_200_adds_at_once_get_200_or_503_with_retry_after_and_only_the_200s_are_stored(
    stack: Stack,
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    bodies = burst(user)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        replies = await asyncio.gather(*(post(session, stack, "/api/v1/add", b) for b in bodies))
    check_replies(bodies, replies, await stored(stack, user))


async def test_while_the_limit_is_held_every_other_add_gets_503_and_stores_nothing(
    stack: Stack,
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    bodies = burst(user)
    warm = await stored(stack, user)  # the gateway's channel to the store is up
    assert warm == {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        with paused(stack, "store"):
            tasks = [asyncio.create_task(post(session, stack, "/api/v1/add", b)) for b in bodies]
            # LIMIT adds wait for the stopped store; every other one is answered meanwhile.
            await assert_eventually(lambda: sum(t.done() for t in tasks) >= BURST - LIMIT)
        replies = await asyncio.gather(*tasks)
    assert sorted(reply.status for reply in replies) == [200] * LIMIT + [503] * (BURST - LIMIT)
    check_replies(bodies, replies, await stored(stack, user))


async def test_a_paused_store_gives_503_with_retry_after_at_the_read_deadline(
    tmp_path: Path, embedder_address: str
) -> None:
    with running_stack(
        tmp_path, ["store", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_READ_DEADLINE="1s",
    ) as short:
        async with aiohttp.ClientSession() as session:
            body = {"user_id": "alice"}
            first = await post(session, short, "/api/v1/list", body)
            assert first.status == 200, first.body
            with paused(short, "store"):
                reply = await post(session, short, "/api/v1/list", body)
                async with session.get(short.base_url + "/healthz") as health:
                    assert health.status == 200
            assert reply.status == 503 and reply.retry_after == "1", reply.body
            assert "unavailable" in reply.body["error"]

            async def answers() -> None:
                again = await post(session, short, "/api/v1/list", body)
                assert again.status == 200, again.body

            await assert_eventually(answers)


async def test_a_write_waiting_for_its_llm_extraction_gives_its_slot_back(
    tmp_path: Path, embedder_address: str
) -> None:
    with fake_llm_in_thread() as llm, running_stack(
        tmp_path, ["store", "extractor", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_MODE="pro", HYATLAS_SYNC_EXTRACT="on",
        HYATLAS_LLM_BASE=llm.url, HYATLAS_LLM_MODEL="scripted", HYATLAS_LLM_KEY="k",
        HYATLAS_MAX_IN_FLIGHT="1", HYATLAS_QUEUE_WAIT="0",
    ) as stack:
        llm.default = HANG
        async with aiohttp.ClientSession() as session:
            body = {"text": "Remind me to water the ferns", "user_id": "alice"}
            waiting = asyncio.create_task(post(session, stack, "/api/v1/add", body))
            await assert_eventually(lambda: len(llm.requests) > 0)
            # The one slot is free again although the write still waits for the LLM.
            listed = await post(session, stack, "/api/v1/list", {"user_id": "alice"})
            assert listed.status == 200, listed.body
            assert [m["content"] for m in listed.body["memories"]] == [body["text"]]
            assert not waiting.done()
            waiting.cancel()


async def test_the_embedder_queue_refuses_calls_past_its_bound_but_takes_any_call_when_empty(
) -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def run(texts: list[str]) -> np.ndarray:
        started.set()
        await release.wait()
        return np.ones((len(texts), 2), dtype=np.float32)

    async with MicroBatcher(run, max_batch=8, max_queue=3) as batcher:
        # Ten texts, more than the bound, into an empty queue: taken; the run holds eight.
        first = asyncio.create_task(batcher.embed(["t"] * 10))
        await started.wait()
        assert batcher.waiting_vectors == 2
        second = asyncio.create_task(batcher.embed(["u"]))
        await assert_eventually(lambda: batcher.waiting_vectors == 3)
        with pytest.raises(Overloaded, match="queue is full"):
            await batcher.embed(["v"])
        release.set()
        assert (await first).shape == (10, 2) and (await second).shape == (1, 2)
        assert (await batcher.embed(["w"] * 10)).shape == (10, 2)


async def test_bulk_texts_take_no_room_from_writes_and_wait_their_turn() -> None:
    runs: list[list[str]] = []
    started, release = asyncio.Event(), asyncio.Event()

    async def run(texts: list[str]) -> np.ndarray:
        runs.append(texts)
        started.set()
        await release.wait()
        return np.ones((len(texts), 2), dtype=np.float32)

    async with MicroBatcher(run, max_batch=4, max_queue=3) as batcher:
        first = asyncio.create_task(batcher.embed(["w0"]))
        await started.wait()
        # An import's batch, past the bound, waits in its own queue: a write still gets in.
        bulk = asyncio.create_task(batcher.embed([f"b{n}" for n in range(10)], bulk=True))
        await assert_eventually(lambda: batcher.waiting_vectors == 10)
        writes = [asyncio.create_task(batcher.embed([f"w{n}"])) for n in (1, 2, 3)]
        await assert_eventually(lambda: batcher.waiting_vectors == 13)
        with pytest.raises(Overloaded, match="embedder queue is full"):
            await batcher.embed(["w4"])
        # Bulk calls are bounded among themselves the same way, but wait for room, unrefused:
        # a second import's batch goes in once the first's texts are all in runs.
        second = asyncio.create_task(batcher.embed(["c0", "c1"], bulk=True))
        await asyncio.sleep(0)
        assert batcher.waiting_vectors == 13 and not second.done()
        release.set()
        await asyncio.gather(first, bulk, *writes, second)
    # A write had just run, so the bulk call's turn came first: a short run (one text here,
    # see the test below); then the writes queued behind it, then its texts a short run at a
    # time, as writes had just run, then full runs.
    assert runs[:3] == [["w0"], ["b0"], ["w1", "w2", "w3"]]
    short = SHORT_BULK_RUNS
    assert runs[3:] == [[f"b{n}"] for n in range(1, short + 1)] + [
        [f"b{n}" for n in range(short + 1, 10)], ["c0", "c1"]
    ]


async def test_writes_that_never_pause_leave_bulk_texts_every_other_run() -> None:
    """Writers that always have a write queued once held an import's texts back until its
    deadline: now a bulk run comes after every OTHER_RUNS_PER_BULK runs of writes."""
    runs: list[list[str]] = []
    writes: list[asyncio.Task[np.ndarray]] = []

    async def run(texts: list[str]) -> np.ndarray:
        runs.append(texts)
        if texts[0].startswith("w") and len(writes) < 100:
            # A write was always queued when a run ended: the next comes before this one ends.
            queued = batcher.waiting_calls
            writes.append(asyncio.create_task(batcher.embed([f"w{len(writes)}"])))
            await assert_eventually(lambda: batcher.waiting_calls > queued)
        return np.ones((len(texts), 2), dtype=np.float32)

    async with MicroBatcher(run, max_batch=8) as batcher:
        writes.append(asyncio.create_task(batcher.embed(["w"])))
        bulk = asyncio.create_task(batcher.embed([f"b{n}" for n in range(12)], bulk=True))
        await bulk
        assert len(writes) < 100  # done while the writes kept coming
        await asyncio.gather(*writes)
    kinds = "".join(texts[0][0] for texts in runs)
    assert kinds.startswith(("w" * OTHER_RUNS_PER_BULK + "b") * 6)
    # Short runs (a quarter of eight texts) while the writes keep coming.
    assert [len(texts) for texts in runs if texts[0].startswith("b")] == [2] * 6


@pytest.mark.parametrize(
    "bounds",
    [{"max_batch": 8}, {"max_batch": 64, "tokens_of": len, "max_tokens": 32}],
    ids=["texts", "padded tokens"],
)
async def test_bulk_runs_are_short_while_other_texts_keep_coming(bounds: dict[str, Any]) -> None:
    """Bulk texts alone run in full runs (eight texts of four tokens, by either bound); after
    a write's run, the next SHORT_BULK_RUNS bulk runs take a quarter as much, so a write that
    comes meanwhile waits for a short run; another write starts the count again."""
    runs: list[list[str]] = []
    pause_at, paused, go_on = -1, asyncio.Event(), asyncio.Event()

    async def run(texts: list[str]) -> np.ndarray:
        runs.append(texts)
        if len(runs) == pause_at:
            paused.set()
            await go_on.wait()
        return np.ones((len(texts), 2), dtype=np.float32)

    texts = [f"b{n:03}" for n in range(100)]
    async with MicroBatcher(run, **bounds) as batcher:
        await batcher.embed(texts[:20], bulk=True)
        assert [len(run_texts) for run_texts in runs] == [8, 8, 4]
        runs.clear()
        await batcher.embed(["w"])
        pause_at = 3  # the write's run, then two short bulk runs: a write comes meanwhile
        bulk = asyncio.create_task(batcher.embed(texts[20:], bulk=True))
        await paused.wait()
        write = asyncio.create_task(batcher.embed(["v"]))
        await assert_eventually(lambda: batcher.waiting_calls == 2)
        go_on.set()
        await asyncio.gather(bulk, write)
    sizes = [len(run_texts) for run_texts in runs]
    assert sizes[:4] == [1, 2, 2, 1] and runs[3] == ["v"]
    rest = 80 - 4 - 2 * SHORT_BULK_RUNS
    assert sizes[4:] == [2] * SHORT_BULK_RUNS + [8] * (rest // 8) + [rest % 8]
    bulk_texts = [text for run_texts in runs if run_texts[0].startswith("b") for text in run_texts]
    assert bulk_texts == texts[20:]


async def test_a_write_cancelled_at_its_deadline_leaves_the_store_writable(tmp_path: Path) -> None:
    """A deadline may cancel a write while its BEGIN is still on SQLite's thread; the next write
    must not find a transaction left open."""
    async with Repo(tmp_path / "hyatlas.db") as repo:

        async def write(value: str) -> None:
            async with repo.transaction() as tx:
                await tx.set_state("k", value, 1.0)

        for _ in range(3):
            cancelled = asyncio.create_task(write("lost"))
            await asyncio.sleep(0)  # it has handed its BEGIN to SQLite's thread
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            await write("kept")
        assert await repo.get_state("k") == [("k", "kept")]
