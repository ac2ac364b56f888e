"""The daily cross-topic schema pass through the real stack with a scripted LLM."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.pb import common_pb2, store_pb2
from tests.extractor_support import Api
from tests.llm_fake import FakeLlm, Recorded, fake_llm_in_thread
from tests.support import assert_eventually, running_stack
from tests.test_consolidator import (
    EMPTY,
    STACK,
    Script,
    digest,
    facts_from_turns,
    marker,
    store_apply,
    ultra_env,
)

pytestmark = pytest.mark.slow

L6 = common_pb2.L6_SCHEMA
PLACES = ["Rome", "Oslo", "Lima", "Kyoto", "Cairo", "Quito", "Hanoi", "Dakar"]


@pytest.fixture(scope="module")
def fake(store_backend: str) -> Iterator[FakeLlm]:
    with fake_llm_in_thread() as fake:
        yield fake


@pytest.fixture(scope="module")
def script(store_backend: str, fake: FakeLlm) -> Script:
    return Script(fake)


def schema(user: str, content: str, facts: list[str], cluster: int) -> store_pb2.Op:
    return store_pb2.Op(
        insert=store_pb2.NewMemory(
            owner=common_pb2.Owner(user_id=user),
            layer=L6,
            content=content,
            source_ids=facts,
            metadata_json=json.dumps({"cluster": cluster}),
        )
    )


def cross_calls(script: Script, user: str) -> list[Recorded]:
    return [r for r in script.calls(user) if r.user_message.startswith("PATTERNS:")]


def shown_patterns(record: Recorded) -> list[str]:
    return [
        found.group(1)
        for line in record.user_message.splitlines()
        if (found := re.match(r"\[\d+\] (.*)", line))
    ]


async def test_cross_topic_pass_generalises_schemas_once_per_interval_across_restarts(
    tmp_path: Path, embedder_address: str, fake: FakeLlm, script: Script
) -> None:
    env = ultra_env(fake, embedder_address, HYATLAS_CROSS_SCHEMA_EVERY="1h")
    with running_stack(tmp_path, STACK, **env) as stack:
        api = Api(stack.base_url, stack.address("store"))
        user, one_topic = marker(), marker()
        texts = [f"{user} grows tomatoes", f"{user} grows basil"]
        texts += [f"{user} flew to Rome", f"{user} flew to Oslo"]
        _, facts = await facts_from_turns(api, user, [(t, i) for i, t in enumerate(texts)], 4)
        garden = [facts[texts[0]].id, facts[texts[1]].id]
        travel = [facts[texts[2]].id, facts[texts[3]].id]
        # Two old schemas, then 40 newer ones from two topics; one runs past 300 characters.
        oldest = [f"{user} old habit {n} of reading maps at night" for n in range(2)]
        await store_apply(api.store_address, user, *[schema(user, t, garden, 1) for t in oldest])
        newer = [f"{user} waters the garden plot number {n} at dawn" for n in range(20)]
        newer += [
            f"{user} books a flight to {p} in week {n}" for n in range(20) for p in [PLACES[n % 8]]
        ]
        newer[-1] += " and keeps a travel journal" + " of every meal" * 30
        ops = [
            schema(user, t, garden if i < 20 else travel, 1 if i < 20 else 2)
            for i, t in enumerate(newer)
        ]
        await store_apply(api.store_address, user, *ops)
        # Someone whose four schemas all come from one topic gets no cross-topic call.
        _, lone = await facts_from_turns(api, one_topic, [(f"{one_topic} runs daily", 0)], 1)
        lone_ids = [r.id for r in lone.values()]
        await store_apply(
            api.store_address,
            one_topic,
            *[
                schema(one_topic, f"{one_topic} runs in the park {n}", lone_ids, 1)
                for n in range(4)
            ],
        )
        broader = f"{user} plans everything ahead, from planting to travel"
        repeat = newer[0]
        # As near to newer[0] as a repeat (cosine about 0.97), but it names another number.
        changed = f"{user} waters the garden plot number 0 twice at dawn"

        def answer(r: Recorded) -> Any:
            if not r.user_message.startswith("PATTERNS:"):
                return EMPTY
            garden_n, travel_n = r.number_of(newer[0]), r.number_of(newer[20])
            return {
                "patterns": [
                    {"text": broader, "schemas": [garden_n, travel_n]},
                    {"text": repeat, "schemas": [garden_n, travel_n]},
                    {"text": changed, "schemas": [garden_n, travel_n]},
                ]
            }

        script.handlers[user] = answer
        report = await digest(api)
        assert report["cross_schemas"] == 2
        assert [e for e in report["errors"] if "repeats a schema" in e] == [
            f"cross-topic pattern {repeat[:60]!r} repeats a schema"
        ]
        [call] = cross_calls(script, user)
        assert cross_calls(script, one_topic) == []
        shown = shown_patterns(call)
        # Only schema texts, the newest 40, each cut to 300 characters.
        assert call.user_message.splitlines()[0] == "PATTERNS:"
        assert len(shown) == len(call.user_message.splitlines()) - 1 == 40
        assert sorted(shown) == sorted(t[:300] for t in newer)
        assert newer[-1][:300] in shown and len(newer[-1]) > 300
        assert not any(o in call.user_message for o in oldest)
        assert not any(f.id in call.prompt for f in facts.values())
        for text in texts:
            assert text not in call.prompt

        wanted = (broader, repeat, changed)
        rows = [r for r in await api.rows(user, "l6_schema") if r.content in wanted]
        cross = [r for r in rows if json.loads(r.metadata_json or "{}").get("cross_topic")]
        assert sorted(r.content for r in cross) == sorted([broader, changed])
        assert all(r.status == "active" for r in cross)
        assert all(list(r.source_ids) == garden + travel for r in cross)
        assert [r.content for r in rows if r.content == repeat] == [repeat]

        # A second pass within the interval makes no cross-topic call, even after a restart.
        await digest(api)
        stack.procs["consolidator"].stop()
        stack.start("consolidator")
        # A start-up catch-up pass may hold the lock for a moment.
        async def digested() -> None:
            await digest(api)

        await assert_eventually(digested, interval_s=0.2)
        assert len(cross_calls(script, user)) == 1
        assert [r.content for r in await api.rows(user, "l6_schema")].count(broader) == 1

        # Retiring a fact behind it marks the cross-topic schema stale.
        await store_apply(
            api.store_address,
            user,
            store_pb2.Op(retire=store_pb2.RetireOp(id=garden[0], superseded_how="dropped")),
        )
        stale = {r.content: r for r in await api.rows(user, "l6_schema")}[broader]
        assert (stale.status, stale.superseded_how) == ("retired", "stale")
        del script.handlers[user]
