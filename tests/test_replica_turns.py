"""Two extractors and two consolidators on one store take turns through the store's leases."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shared.pb import (
    common_pb2,
    consolidator_pb2,
    consolidator_pb2_grpc,
    extractor_pb2,
    extractor_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)
from shared.rpc import open_channel
from tests.llm_fake import HANG, FakeLlm, Recorded, delayed, fake_llm_in_thread
from tests.support import ServiceProcess, Stack, assert_eventually, grpc_serving, running_stack

pytestmark = pytest.mark.slow

EMPTY = {"merges": [], "drops": [], "schemas": [], "edges": [], "end_edges": [], "arc": ""}
L2, L3 = common_pb2.L2_RAW, common_pb2.L3_FACT
MONTHS = ("May", "June", "July")
"""Facts that differ in a month only: one cluster per owner."""
CALL_S = 0.5
"""How long the scripted model takes per call: long enough for two replicas to overlap."""


@pytest.fixture(scope="module")
def fake(store_backend: str) -> Iterator[FakeLlm]:
    with fake_llm_in_thread() as fake:
        fake.default = {}
        yield fake


def _env(fake: FakeLlm, embedder_address: str, lease_ttl: str) -> dict[str, str]:
    return {
        "HYATLAS_EMBEDDER_ADDR": embedder_address,
        "HYATLAS_MODE": "ultra",
        "HYATLAS_LLM_BASE": fake.url,
        "HYATLAS_LLM_MODEL": "scripted",
        "HYATLAS_LLM_KEY": "key",
        "HYATLAS_EXTRACT_TIMEOUT": "30s",
        "HYATLAS_CATCHUP_EVERY": "1s",
        "HYATLAS_CATCHUP_MIN_AGE": "0",
        "HYATLAS_EPISODE_GAP": "off",
        "HYATLAS_CONSOLIDATE_BATCH": "4",
        "HYATLAS_CONSOLIDATE_PARALLEL": "1",
        "HYATLAS_CROSS_SCHEMA_EVERY": "off",
        "HYATLAS_LEASE_TTL": lease_ttl,
    }


@dataclass
class Replica:
    """One copy of a service and the address it serves on."""

    proc: ServiceProcess
    address: str


def start_replica(stack: Stack, service: str, name: str) -> Replica:
    """Starts a copy of a service on its own socket, stopped with the stack."""
    address = f"unix:{stack.data_dir / 'run' / (name + '.sock')}"
    env = {**stack.env, f"HYATLAS_{service.upper()}_ADDR": address}
    proc = ServiceProcess(
        f"services.{service}", env, lambda: grpc_serving(address), stack.data_dir / f"{name}.log"
    )
    stack.procs[name] = proc.start()
    return Replica(proc, address)


async def insert(stack: Stack, user: str, layer: int, *texts: str, **fields: Any) -> None:
    owner = common_pb2.Owner(user_id=user)
    ops = [
        store_pb2.Op(
            insert=store_pb2.NewMemory(
                owner=owner, layer=layer, content=text, **fields  # type: ignore[arg-type]
            )
        )
        for text in texts
    ]
    async with open_channel(stack.address("store")) as channel:
        await store_pb2_grpc.StoreStub(channel).Apply(
            store_pb2.ApplyRequest(scope=common_pb2.Scope(user_id=user), ops=ops), timeout=30
        )


async def rows(stack: Stack, layer: int) -> list[common_pb2.Memory]:
    async with open_channel(stack.address("store")) as channel:
        reply = await store_pb2_grpc.StoreStub(channel).ListMemories(
            store_pb2.ListMemoriesRequest(
                scope=common_pb2.Scope(all_users=True),
                layers=[layer],  # type: ignore[list-item]
                include_superseded=True,  # a fact near another is retired as restated
                limit=1000,
            ),
            timeout=10,
        )
    return list(reply.memories)


async def leases(stack: Stack) -> dict[str, str]:
    async with open_channel(stack.address("store")) as channel:
        reply = await store_pb2_grpc.StoreStub(channel).GetState(
            store_pb2.GetStateRequest(prefix="lease/"), timeout=10
        )
    return {v.key: v.value_json for v in reply.values}


def holder_pid(value_json: str) -> int:
    """The process a lease's holder names (host:pid:random)."""
    return int(json.loads(value_json)["holder"].split(":")[1])


async def test_two_extractors_extract_each_pending_row_once(
    tmp_path: Path, embedder_address: str, fake: FakeLlm
) -> None:
    tags = [f"t{uuid.uuid4().hex[:8]}" for _ in range(12)]
    for tag in tags:
        fake.on(tag, delayed(CALL_S, {"facts": [{"text": f"{tag} keeps bees"}]}))
    env = _env(fake, embedder_address, lease_ttl="30s")
    with running_stack(tmp_path, ["store"], **env) as stack:
        # Three owners, their rows interleaved, all pending before either extractor starts.
        for i, tag in enumerate(tags):
            await insert(
                stack, f"owner-{i % 3}", L2, f"{tag} I keep bees on the roof.",
                extraction_status="pending", write_mode="ultra",
            )
        first = start_replica(stack, "extractor", "extractor")
        second = start_replica(stack, "extractor", "extractor-2")

        async def all_done() -> None:
            assert all(r.extraction_status == "done" for r in await rows(stack, L2))

        await assert_eventually(all_done)
        facts = [f.content for f in await rows(stack, L3)]
        for tag in tags:
            assert len(fake.for_marker(tag)) == 1, tag
            assert facts.count(f"{tag} keeps bees") == 1, facts
        extracted = 0
        for replica in (first, second):
            async with open_channel(replica.address) as channel:
                status = await extractor_pb2_grpc.ExtractorStub(channel).GetLlmStatus(
                    extractor_pb2.GetLlmStatusRequest(), timeout=10
                )
            extracted += status.extracted
        assert extracted == len(tags)
        await assert_eventually(lambda: _released(stack))


async def _released(stack: Stack) -> None:
    assert await leases(stack) == {}


async def run_pass(replica: Replica) -> consolidator_pb2.RunPassResponse:
    async with open_channel(replica.address) as channel:
        reply: consolidator_pb2.RunPassResponse = await consolidator_pb2_grpc.ConsolidatorStub(
            channel
        ).RunPass(consolidator_pb2.RunPassRequest(), timeout=60)
    return reply


async def test_two_consolidators_never_run_passes_at_once_and_a_killed_ones_lease_expires(
    tmp_path: Path, embedder_address: str, fake: FakeLlm
) -> None:
    users = [f"c{uuid.uuid4().hex[:8]}" for _ in range(3)]
    hanging: set[str] = set()

    def answer(record: Recorded) -> Any:
        if any(user in record.user_message for user in hanging):
            return HANG
        return delayed(CALL_S, EMPTY)

    fake.answer = answer
    # Short enough that a killed replica's lease is waited out, long enough not to be lost.
    env = _env(fake, embedder_address, lease_ttl="5s")
    with running_stack(tmp_path, ["store"], **env) as stack:
        texts = {u: [f"{u} grows tomatoes on the balcony in {m}" for m in MONTHS] for u in users}
        for user in users:
            await insert(stack, user, L3, *texts[user])
        # Both start with due clusters, so both try a catch-up pass at once.
        first = start_replica(stack, "consolidator", "consolidator")
        second = start_replica(stack, "consolidator", "consolidator-2")

        def shown(text: str) -> list[Recorded]:
            return [r for r in fake.requests if text in r.user_message]

        await assert_eventually(lambda: all(shown(t) for ts in texts.values() for t in ts))
        assert all(len(shown(t)) == 1 for ts in texts.values() for t in ts)
        calls = sorted(r.at for u in users for r in fake.requests if u in r.user_message)
        # One call at a time in a pass (PARALLEL=1): calls closer than a call's length would
        # have come from two passes at once.
        assert all(b - a >= CALL_S * 0.9 for a, b in zip(calls, calls[1:], strict=False)), calls
        await assert_eventually(lambda: _released(stack))

        # A pass that hangs holds the lease in the store; the other replica is refused. Both
        # are asked, again while both are refused (one may be surveying after its start).
        late = f"c{uuid.uuid4().hex[:8]}"
        hanging.add(late)
        await insert(stack, late, L3, *[f"{late} plans a trip to Rome in {m}" for m in MONTHS])
        asked: list[asyncio.Task[consolidator_pb2.RunPassResponse]] = []

        async def a_pass_hangs() -> None:
            if all(task.done() for task in asked):
                asked[:] = [asyncio.create_task(run_pass(r)) for r in (first, second)]
            assert any(late in r.user_message for r in fake.requests)

        await assert_eventually(a_pass_hangs)
        (held,) = (await leases(stack)).values()
        pids = [r.proc.proc.pid if r.proc.proc else 0 for r in (first, second)]
        holder, other = (first, second) if holder_pid(held) == pids[0] else (second, first)
        assert holder_pid(held) in pids
        refused = await run_pass(other)
        assert not refused.ran, refused.reason

        # Killed, it never releases the lease: it expires (HYATLAS_LEASE_TTL) and the other
        # replica's pass runs.
        holder.proc.kill()
        await asyncio.gather(*asked, return_exceptions=True)
        hanging.clear()

        async def other_runs() -> None:
            assert (await run_pass(other)).ran

        await assert_eventually(other_runs)
        assert len([r for r in fake.requests if late in r.user_message]) == 2  # hung, then sent
        await assert_eventually(lambda: _released(stack))
