"""Ultra passes through the real stack with a scripted LLM: what the model sees, what lands."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.consolidator.cluster_pass import standing
from shared.pb import (
    common_pb2,
    consolidator_pb2,
    consolidator_pb2_grpc,
    store_pb2,
    store_pb2_grpc,
)
from shared.rpc import open_channel
from shared.store_client import GraphStoreClient
from tests.extractor_support import Api
from tests.llm_fake import ERROR, HANG, FakeLlm, Recorded, fake_llm_in_thread, held
from tests.support import Stack, assert_eventually, running_stack

pytestmark = pytest.mark.slow

STACK = ["store", "consolidator", "gateway"]
EMPTY = {"merges": [], "drops": [], "schemas": [], "edges": [], "end_edges": [], "arc": ""}
L2, L3 = common_pb2.L2_RAW, common_pb2.L3_FACT


class Script:
    """Answers consolidation calls by the test marker their facts carry; others get EMPTY."""

    def __init__(self, fake: FakeLlm) -> None:
        self.fake = fake
        self.handlers: dict[str, Callable[[Recorded], Any]] = {}
        fake.answer = self._answer

    def _answer(self, record: Recorded) -> Any:
        for marker, handler in list(self.handlers.items()):
            if marker in record.user_message:
                return handler(record)
        return EMPTY

    def calls(self, marker: str) -> list[Recorded]:
        """The requests whose prompt showed a fact carrying marker."""
        return [r for r in self.fake.requests if marker in r.user_message]


def ultra_env(fake: FakeLlm, embedder_address: str, **extra: str) -> dict[str, str]:
    return {
        "HYATLAS_EMBEDDER_ADDR": embedder_address,
        "HYATLAS_MODE": "ultra",
        "HYATLAS_LLM_BASE": fake.url,
        "HYATLAS_LLM_MODEL": "scripted",
        "HYATLAS_LLM_KEY": "key",
        "HYATLAS_EXTRACT_TIMEOUT": "20s",
        "HYATLAS_CONSOLIDATE_BATCH": "4",
        "HYATLAS_CROSS_SCHEMA_EVERY": "off",
        **extra,
    }


@pytest.fixture(scope="module")
def fake(store_backend: str) -> Iterator[FakeLlm]:
    with fake_llm_in_thread() as fake:
        yield fake


@pytest.fixture(scope="module")
def script(store_backend: str, fake: FakeLlm) -> Script:
    return Script(fake)


@pytest.fixture(scope="module")
def ultra(
    store_backend: str,
    tmp_path_factory: pytest.TempPathFactory, embedder_address: str, fake: FakeLlm
) -> Iterator[Stack]:
    data_dir: Path = tmp_path_factory.mktemp("consolidator")
    with running_stack(data_dir, STACK, **ultra_env(fake, embedder_address)) as stack:
        yield stack


@pytest.fixture
def api(ultra: Stack) -> Api:
    return Api(ultra.base_url, ultra.address("store"))


async def store_apply(address: str, user: str, *ops: store_pb2.Op) -> list[common_pb2.Memory]:
    async with open_channel(address) as channel:
        reply = await store_pb2_grpc.StoreStub(channel).Apply(
            store_pb2.ApplyRequest(scope=common_pb2.Scope(user_id=user), ops=ops), timeout=30
        )
    return list(reply.memories)


def new(user: str, layer: int, content: str, sources: list[str] | None = None) -> store_pb2.Op:
    return store_pb2.Op(
        insert=store_pb2.NewMemory(
            owner=common_pb2.Owner(user_id=user),
            layer=layer,  # type: ignore[arg-type]
            content=content,
            source_ids=sources or [],
        )
    )


def extracted_turn(user: str, content: str) -> store_pb2.Op:
    """A raw turn whose extraction is over (raw retention deletes only such turns)."""
    op = new(user, L2, content)
    op.insert.extraction_status = "done"
    return op


async def facts_from_turns(
    api: Api, user: str, facts: list[tuple[str, int]], turns: int
) -> tuple[list[str], dict[str, common_pb2.Memory]]:
    """Writes `turns` raw turns and the facts (text, turn index) extracted from them."""
    raws = await store_apply(
        api.store_address, user, *[extracted_turn(user, f"{user} turn {n}") for n in range(turns)]
    )
    raw_ids = [r.id for r in raws]
    rows = await store_apply(
        api.store_address, user, *[new(user, L3, text, [raw_ids[t]]) for text, t in facts]
    )
    return raw_ids, {r.content: r for r in rows}


async def digest(api: Api) -> dict[str, Any]:
    body = await api.ok("POST", "/api/v1/digest", timeout=120)
    assert body["digest_ok"] is True, body
    return body["report"]  # type: ignore[no-any-return]


async def settle(api: Api) -> None:
    """Runs passes until no cluster anywhere is due (other tests' leftovers answer EMPTY)."""
    await assert_eventually(lambda: _nothing_pending(api), interval_s=0.1)


async def _nothing_pending(api: Api) -> bool:
    report = await digest(api)
    return report["clusters_pending"] == 0 and report["clusters_run"] == 0


async def state_of(api: Api, user: str) -> list[dict[str, Any]]:
    async with open_channel(api.store_address) as channel:
        reply = await store_pb2_grpc.StoreStub(channel).GetState(
            store_pb2.GetStateRequest(prefix=f"consolidator/cluster/{user}/"), timeout=10
        )
    return [json.loads(v.value_json) for v in reply.values]


def marker() -> str:
    return f"m{uuid.uuid4().hex[:8]}"


async def test_a_pass_merges_drops_and_builds_schemas_and_edges_with_evidence_and_undoes(
    api: Api, script: Script
) -> None:
    user = marker()
    a = f"{user} project Foxtrot uses Postgres 15 for storage"
    b = f"{user} project Foxtrot stores its data in Postgres 15"
    c = f"{user} said good morning"
    d = f"{user} project Foxtrot deploys every Friday"
    raw_ids, rows = await facts_from_turns(api, user, [(a, 0), (b, 1), (c, 2), (d, 1)], 3)
    merged_text = f"{user} project Foxtrot stores its data in Postgres 15"

    def answer(r: Recorded) -> dict[str, Any]:
        return {
            "merges": [{"facts": [r.number_of(a), r.number_of(b)], "text": merged_text}],
            "drops": [
                {"fact": r.number_of(c), "reason": "small talk"},
                {"fact": 99, "reason": "x"},
            ],
            "schemas": [
                {
                    "text": "Foxtrot ships on a weekly rhythm",
                    "facts": [r.number_of(a), r.number_of(d)],
                }
            ],
            "edges": [
                {
                    "subject": "Foxtrot",
                    "relation": "uses",
                    "object": "Postgres 15",
                    "facts": [r.number_of(a), r.number_of(b)],
                },
                {
                    "subject": "Foxtrot",
                    "relation": "deploys on",
                    "object": "Friday",
                    "facts": [r.number_of(d)],
                },
            ],
            "end_edges": [],
            "arc": f"{user} is building Foxtrot on Postgres.",
        }

    script.handlers[user] = answer
    report = await digest(api)
    (call,) = script.calls(user)
    assert "[E" not in call.user_message and user in call.user_message
    assert all(row.id not in call.prompt for row in rows.values())  # local numbers only
    assert (report["merged"], report["dropped"], report["schemas"], report["edges"]) == (2, 1, 1, 1)
    assert report["arc"] is True
    assert report["dropped_ops"] >= 2
    assert any("one turn only" in e for e in report["errors"])
    assert any("not shown" in e for e in report["errors"])

    facts = await api.rows(user, "l3_fact")
    by_text = {f.content: f for f in facts if f.status == "active"}
    merged = by_text[merged_text]
    assert merged.id not in (rows[a].id, rows[b].id)
    assert set(merged.source_ids) == {raw_ids[0], raw_ids[1]}
    for old in (a, b):
        row = await api.row(user, rows[old].id)
        assert (row.status, row.superseded_how, row.superseded_by) == (
            "retired",
            "merged",
            merged.id,
        )
        assert row.pass_id == report["pass_id"]
    dropped = await api.row(user, rows[c].id)
    assert (dropped.superseded_how, dropped.drop_reason) == ("dropped", "small talk")
    (schema,) = [s for s in await api.rows(user, "l6_schema") if s.status == "active"]
    assert set(schema.source_ids) == {merged.id, rows[d].id}
    (knowledge,) = await api.rows(user, "l5_knowledge")
    assert knowledge.content == "Foxtrot uses Postgres 15"

    edges = await api.ok("GET", "/api/v1/edges", params={"user_id": user})
    (edge,) = edges["knowledge"]
    assert (edge["from"], edge["relation"], edge["to"]) == ("foxtrot", "uses", "postgres 15")
    assert set(edge["sources"]) == {raw_ids[0], raw_ids[1]}
    graph = await api.ok("GET", "/api/v1/graph", params={"node": "Foxtrot", "user_id": user})
    assert graph["neighbors"] == [{"label": "Postgres 15", "relation": "uses", "incoming": False}]
    status = await api.status()
    assert status["consolidations"] >= 1 and "last_consolidated" in status
    # When the last pass ended (the dashboard's overview shows it).
    assert status["last_consolidated_at"] == (await api.ok("GET", "/api/v1/digest"))["last_at"]
    assert status["graph_edges"] >= 1

    # Nothing changed: the next pass sends this owner's cluster nowhere.
    await digest(api)
    assert len(script.calls(user)) == 1

    # Retiring the fact behind the edge hides it; restoring brings it back.
    forget = store_pb2.Op(retire=store_pb2.RetireOp(id=merged.id, superseded_how="forgotten"))
    await store_apply(api.store_address, user, forget)
    assert (await api.ok("GET", "/api/v1/edges", params={"user_id": user}))["knowledge"] == []
    await store_apply(
        api.store_address, user, store_pb2.Op(restore=store_pb2.RestoreOp(id=merged.id))
    )
    edges = await api.ok("GET", "/api/v1/edges", params={"user_id": user})
    assert [e["id"] for e in edges["knowledge"]] == [edge["id"]]

    # One call reverts the whole pass.
    undone = await api.ok("POST", "/api/v1/digest/undo", json={"pass_id": report["pass_id"]})
    assert set(undone["restored"]) >= {rows[a].id, rows[b].id, rows[c].id}
    live = {f.content for f in await api.rows(user, "l3_fact", retired=False)}
    assert live == {a, b, c, d}
    assert [s for s in await api.rows(user, "l6_schema") if s.status == "active"] == []
    assert [k for k in await api.rows(user, "l5_knowledge") if k.status == "active"] == []
    assert (await api.ok("GET", "/api/v1/edges", params={"user_id": user}))["knowledge"] == []
    arcs = [s for s in await api.rows(user, "l4_summary") if s.status == "active"]
    assert arcs == []
    # The undone cluster is not sent again until its facts change.
    await digest(api)
    assert len(script.calls(user)) == 1
    del script.handlers[user]


@pytest.mark.parametrize("then_erased", [False, True])
async def test_undo_keeps_retired_a_dropped_copy_of_a_value_forgotten_since(
    api: Api, script: Script, then_erased: bool
) -> None:
    user = marker()
    jazz = f"{user} listens to modal jazz records every evening"
    other = f"{user} project Foxtrot deploys every Friday"
    raws = await store_apply(
        api.store_address, user, *[new(user, L2, f"{user} turn {n}") for n in range(2)]
    )
    copies = await store_apply(
        api.store_address, user,
        *[new(user, L3, text, [raws[t].id]) for text, t in ((jazz, 0), (jazz, 1), (other, 1))],
    )
    script.handlers[user] = lambda r: {
        **EMPTY, "drops": [{"fact": r.number_of(jazz), "reason": "said twice"}],
    }
    report = await digest(api)
    assert report["dropped"] == 1
    (dropped,) = [f for f in await api.rows(user, "l3_fact") if f.superseded_how == "dropped"]
    (live,) = [f for f in copies[:2] if f.id != dropped.id]
    forgotten = await api.ok("POST", "/api/v1/forget", json={"text": jazz, "user_id": user})
    assert [m["memory_id"] for m in forgotten["memories"]] == [live.id]
    if then_erased:  # the tombstone on its turn is all that says the value is forgotten
        await api.ok("POST", "/api/v1/delete_all", json={"id": live.id, "user_id": user})

    undone = await api.ok("POST", "/api/v1/digest/undo", json={"pass_id": report["pass_id"]})
    assert (undone["restored"], undone["kept"]) == ([], [dropped.id])
    assert undone["kept_why"] == {dropped.id: "its value was forgotten since"}
    assert (await api.row(user, dropped.id)).superseded_how == "dropped"
    assert [f.content for f in await api.rows(user, "l3_fact", retired=False)] == [other]
    del script.handlers[user]


async def test_facts_of_two_agents_of_one_person_are_never_merged_across_them(
    api: Api, script: Script
) -> None:
    user = f"agents-{uuid.uuid4().hex[:8]}"
    raws = await store_apply(
        api.store_address, user, new(user, L2, f"{user} turn 0"), new(user, L2, f"{user} turn 1")
    )
    work = f"{user} project Kilo stores its data in Postgres 15"
    home = f"{user} project Kilo now stores its data in Postgres 15"
    for agent, text, raw in (("work-bot", work, raws[0]), ("home-bot", home, raws[1])):
        owner = common_pb2.Owner(user_id=user, agent_id=agent)
        insert = store_pb2.NewMemory(owner=owner, layer=L3, content=text, source_ids=[raw.id])
        await store_apply(api.store_address, user, store_pb2.Op(insert=insert))

    def merge(record: Recorded) -> Any:
        if work not in record.user_message or home not in record.user_message:
            return EMPTY
        shown = [record.number_of(work), record.number_of(home)]
        return {**EMPTY, "merges": [{"facts": shown, "text": home}]}

    script.handlers[user] = merge
    await digest(api)
    assert not [r for r in script.calls(user) if work in r.user_message and home in r.user_message]
    facts = await api.rows(user, "l3_fact")
    assert {(f.owner.agent_id, f.content, f.status) for f in facts} == {
        ("work-bot", work, "active"),
        ("home-bot", home, "active"),
    }
    del script.handlers[user]


async def test_malformed_or_partial_replies_retire_nothing(api: Api, script: Script) -> None:
    user = marker()
    a, b = f"{user} likes green tea", f"{user} enjoys green tea a lot"
    _, rows = await facts_from_turns(api, user, [(a, 0), (b, 1)], 2)
    script.handlers[user] = lambda r: "this is not json {"
    report = await digest(api)
    assert report["failed_calls"] >= 1 and report["clusters_pending"] >= 1
    assert any(user in e and "nothing was applied" in e for e in report["errors"])

    # A reply that merges but lacks the other keys is partial: its merge is not applied.
    script.handlers[user] = lambda r: {"merges": [{"facts": [1, 2], "text": a}]}
    report = await digest(api)
    assert any("lacks" in e for e in report["errors"])
    for row in await api.rows(user, "l3_fact"):
        assert row.status == "active"
    assert len(await api.rows(user, "l3_fact")) == 2
    del script.handlers[user]
    await settle(api)


async def test_a_cluster_the_store_refuses_whole_is_not_reported_as_partly_applied(
    api: Api, script: Script
) -> None:
    user = marker()
    a, b = f"{user} likes green tea", f"{user} enjoys green tea a lot"
    await facts_from_turns(api, user, [(a, 0), (b, 1)], 2)
    # A merged text the store refuses (a NUL), with an arc: refused with and without the arc.
    script.handlers[user] = lambda r: {
        **EMPTY, "merges": [{"facts": [1, 2], "text": f"{a}\u0000"}], "arc": f"{user} drinks tea",
    }
    report = await digest(api)
    mine = [e for e in report["errors"] if user in e]
    assert any("applying failed" in e for e in mine), report["errors"]
    assert not any("were applied" in e for e in mine), mine
    assert {row.status for row in await api.rows(user, "l3_fact")} == {"active"}
    del script.handlers[user]
    await settle(api)


async def test_failed_clusters_are_charged_skipped_after_three_and_a_down_provider_charges_none(
    api: Api, script: Script
) -> None:
    await settle(api)
    user = marker()
    texts = [f"{user} topic {word} note" for word in ("alpha", "beta", "gamma", "delta")]
    texts += [f"{user} cooking {word} recipe" for word in ("soup", "bread", "pie", "stew")]
    await facts_from_turns(api, user, [(t, i) for i, t in enumerate(texts)], len(texts))
    script.handlers[user] = lambda r: ERROR
    report = await digest(api)
    assert report["clusters_run"] == 2 and report["provider_down"] is True
    clusters = await state_of(api, user)
    assert len(clusters) == 2 and all(c["fails"] == 0 for c in clusters)

    bad = set(clusters[1]["members"])
    bad_texts = [r.content for r in await api.rows(user, "l3_fact") if r.id in bad]
    script.handlers[user] = lambda r: (
        ERROR if any(t in r.user_message for t in bad_texts) else EMPTY
    )
    for fails in (1, 2, 3):
        report = await digest(api)
        assert report["provider_down"] is False
        state = {c["id"]: c for c in await state_of(api, user)}
        assert state[clusters[1]["id"]]["fails"] == fails
    assert any("skipped for 24h" in e for e in report["errors"])
    before = len(script.calls(user))
    report = await digest(api)
    assert len(script.calls(user)) == before
    assert any("skipped after 3 failed passes" in e for e in report["errors"])
    del script.handlers[user]


async def test_graph_as_of_shows_the_edge_before_its_invalidation_and_not_after(
    api: Api, script: Script
) -> None:
    user = marker()
    a, b = f"{user} Foxtrot runs on Postgres 15", f"{user} Foxtrot database is Postgres 15"
    raw_ids, rows = await facts_from_turns(api, user, [(a, 0), (b, 1)], 3)
    script.handlers[user] = lambda r: {
        **EMPTY,
        "edges": [
            {
                "subject": "Foxtrot",
                "relation": "uses",
                "object": "Postgres 15",
                "facts": [r.number_of(a), r.number_of(b)],
                "valid_from": "2026-01-05",
            }
        ],
    }
    await digest(api)
    (old,) = (await api.ok("GET", "/api/v1/edges", params={"user_id": user}))["knowledge"]
    assert old["valid_from"] == 1767571200
    between = time.time()

    c = f"{user} Foxtrot moved to Postgres 16"
    await store_apply(api.store_address, user, new(user, L3, c, [raw_ids[2]]))
    script.handlers[user] = lambda r: {
        **EMPTY,
        "end_edges": [{"edge": "E1", "valid_to": "2026-03-01"}],
        "edges": [
            {
                "subject": "Foxtrot",
                "relation": "uses",
                "object": "Postgres 16",
                "facts": [r.number_of(a), r.number_of(c)],
            }
        ],
    }
    await digest(api)
    assert "[E1] Foxtrot | uses | Postgres 15" in script.calls(user)[-1].user_message

    then = await api.ok("GET", "/api/v1/graph-as-of", params={"user_id": user, "ts": between})
    now = await api.ok("GET", "/api/v1/graph-as-of", params={"user_id": user})
    assert [e["to"] for e in then["relations"]] == ["postgres 15"]
    assert [e["to"] for e in now["relations"]] == ["postgres 16"]
    assert {n["id"] for n in now["nodes"]} == {"foxtrot", "postgres 16"}
    every = await api.ok("GET", "/api/v1/graph-as-of", params={"user_id": user, "ts": 0})
    assert every["relations"] == []
    del script.handlers[user]


async def test_admin_routes_need_hyatlas_admin(api: Api) -> None:
    status, body = await api.call("POST", "/api/v1/admin/dedupe_facts", json={})
    assert status == 403 and "HYATLAS_ADMIN=on" in body["error"]


async def test_kill_9_in_the_middle_of_a_pass_leaves_no_cluster_half_applied(
    tmp_path: Path, embedder_address: str, fake: FakeLlm, script: Script
) -> None:
    # The killed pass's lease frees itself after HYATLAS_LEASE_TTL, then the restart's starts.
    env = ultra_env(
        fake, embedder_address, HYATLAS_CONSOLIDATE_PARALLEL="1", HYATLAS_LEASE_TTL="4"
    )
    with running_stack(tmp_path, STACK, **env) as stack:
        api = Api(stack.base_url, stack.address("store"))
        user = marker()
        texts = [f"{user} garden {w} plan" for w in ("tomato", "basil", "mint", "chili")]
        texts += [f"{user} travel {w} trip" for w in ("rome", "oslo", "lima", "kyoto")]
        await facts_from_turns(api, user, [(t, i) for i, t in enumerate(texts)], len(texts))
        first_calls = len(script.calls(user))
        seen: list[str] = []

        def answer(r: Recorded) -> Any:
            # The first cluster of the pass drops one fact; the second one hangs.
            shown = [t for t in texts if t in r.user_message]
            if not seen or seen[0] in shown:
                seen[:] = seen or shown
                return {**EMPTY, "drops": [{"fact": r.number_of(shown[0]), "reason": "stale"}]}
            return HANG

        script.handlers[user] = answer
        pass_task = asyncio.create_task(api.call("POST", "/api/v1/digest", timeout=120))
        await assert_eventually(lambda: len(script.calls(user)) >= first_calls + 2)
        stack.procs["consolidator"].kill()
        await asyncio.gather(pass_task, return_exceptions=True)

        rows = {r.content: r for r in await api.rows(user, "l3_fact")}
        done_text = seen[0]
        hung = [t for t in texts if t not in seen]
        assert rows[done_text].superseded_how == "dropped"
        assert all(rows[t].status == "active" for t in texts if t != done_text)
        clusters = await state_of(api, user)
        assert sorted(len(c["members"]) for c in clusters) == [3, 4]
        done_cluster = next(c for c in clusters if len(c["members"]) == 3)
        assert rows[done_text].id not in done_cluster["members"] and done_cluster["done"]
        hung_cluster = next(c for c in clusters if len(c["members"]) == 4)
        assert hung_cluster["done"] == ""

        # The hung cluster is due; a restart begins with a catch-up pass that finishes it.
        script.handlers[user] = lambda r: {
            **EMPTY,
            "drops": [{"fact": r.number_of(hung[0]), "reason": "stale"}],
        }
        stack.start("consolidator")

        async def hung_cluster_done() -> None:
            row = {r.content: r for r in await api.rows(user, "l3_fact")}[hung[0]]
            assert row.superseded_how == "dropped"

        await assert_eventually(hung_cluster_done)
        rows = {r.content: r for r in await api.rows(user, "l3_fact")}
        assert rows[done_text].superseded_how == "dropped"
        assert [t for t in texts if rows[t].status != "active"] == sorted(
            [done_text, hung[0]], key=texts.index
        )
        # The finished cluster was not sent again.
        assert sum(1 for r in script.calls(user) if done_text in r.user_message) == 1
        del script.handlers[user]


async def held_drop(api: Api, script: Script) -> tuple[str, str, threading.Event]:
    """A new user's four facts, whose pass's LLM answer (drop the first) waits for the gate:
    the user, the fact dropped and the gate."""
    await settle(api)
    user = marker()
    texts = [f"{user} garden {w} plan" for w in ("tomato", "basil", "mint", "chili")]
    await facts_from_turns(api, user, [(t, i) for i, t in enumerate(texts)], len(texts))
    gate = threading.Event()
    script.handlers[user] = lambda r: held(
        gate, {**EMPTY, "drops": [{"fact": r.number_of(texts[0]), "reason": "stale"}]}
    )
    return user, texts[0], gate


async def test_a_pass_whose_caller_gives_up_finishes_and_is_the_last_report(
    api: Api, script: Script, ultra: Stack
) -> None:
    user, dropped, gate = await held_drop(api, script)
    async with open_channel(ultra.address("consolidator")) as channel:
        stub = consolidator_pb2_grpc.ConsolidatorStub(channel)
        runs = (await stub.GetDigest(consolidator_pb2.GetDigestRequest(), timeout=10)).runs
        call = stub.RunPass(consolidator_pb2.RunPassRequest(), timeout=120)
        await assert_eventually(lambda: len(script.calls(user)) >= 1)
        call.cancel()  # the caller gives up (a deadline) while the LLM answers
        with contextlib.suppress(asyncio.CancelledError):
            await call
        gate.set()

        async def reported() -> None:
            digest = await stub.GetDigest(consolidator_pb2.GetDigestRequest(), timeout=10)
            assert digest.runs == runs + 1 and not digest.running

        await assert_eventually(reported)
    rows = {r.content: r for r in await api.rows(user, "l3_fact")}
    assert rows[dropped].superseded_how == "dropped"
    del script.handlers[user]


async def test_a_pass_asked_for_while_one_runs_is_refused_and_the_first_goes_on(
    api: Api, script: Script, ultra: Stack
) -> None:
    user, dropped, gate = await held_drop(api, script)
    async with open_channel(ultra.address("consolidator")) as channel:
        stub = consolidator_pb2_grpc.ConsolidatorStub(channel)
        first = stub.RunPass(consolidator_pb2.RunPassRequest(), timeout=120)
        await assert_eventually(lambda: len(script.calls(user)) >= 1)
        second = await stub.RunPass(consolidator_pb2.RunPassRequest(), timeout=30)
        assert not second.ran and "already running" in second.reason
        gate.set()
        assert (await first).ran
    rows = {r.content: r for r in await api.rows(user, "l3_fact")}
    assert rows[dropped].superseded_how == "dropped"
    del script.handlers[user]


async def test_rows_a_pass_builds_on_a_fact_forgotten_while_the_model_answers_are_stale(
    api: Api, script: Script
) -> None:
    await settle(api)
    user = marker()
    a = f"{user} project Foxtrot uses Postgres 15 for storage"
    b = f"{user} project Foxtrot stores its data in Postgres 15"
    d = f"{user} project Foxtrot deploys every Friday"
    _, rows = await facts_from_turns(api, user, [(a, 0), (b, 1), (d, 1)], 2)
    gate = threading.Event()
    script.handlers[user] = lambda r: held(gate, {
        **EMPTY,
        "schemas": [{"text": "Foxtrot ships weekly", "facts": [r.number_of(a), r.number_of(d)]}],
        "edges": [{"subject": "Foxtrot", "relation": "uses", "object": "Postgres 15",
                   "facts": [r.number_of(a), r.number_of(b)]}],
        "arc": f"{user} is building Foxtrot on Postgres 15.",
    })
    try:
        running = asyncio.create_task(digest(api))
        await assert_eventually(lambda: len(script.calls(user)) >= 1)
        await api.ok("POST", "/api/v1/forget", json={"id": rows[a].id, "user_id": user})
        gate.set()
        report = await running
    finally:
        gate.set()
        del script.handlers[user]
    assert (report["schemas"], report["edges"], report["arc"]) == (1, 1, True)
    for layer in ("l6_schema", "l5_knowledge", "l4_summary"):
        written = await api.rows(user, layer)
        assert [(m.status, m.superseded_how) for m in written] == [("retired", "stale")], layer
    assert (await api.ok("GET", "/api/v1/edges", params={"user_id": user}))["knowledge"] == []


async def test_an_arc_rests_on_the_rows_it_stands_on_now_not_on_every_fact_it_was_ever_shown(
    api: Api, script: Script
) -> None:
    await settle(api)
    user = marker()
    a = f"{user} project Foxtrot uses Postgres 15 for storage"
    b = f"{user} project Foxtrot stores its data in Postgres 15"
    c = f"{user} project Foxtrot said good morning"
    _, rows = await facts_from_turns(api, user, [(a, 0), (b, 1), (c, 1)], 2)
    arc = {**EMPTY, "arc": f"{user} is building Foxtrot on Postgres."}
    script.handlers[user] = lambda r: {**arc, "drops": [{"fact": r.number_of(c), "reason": "x"}]}
    try:
        await digest(api)
        e = f"{user} project Foxtrot moved its storage to Postgres 16"
        _, more = await facts_from_turns(api, user, [(e, 0)], 1)
        merged = f"{user} project Foxtrot keeps its data in Postgres 15"
        script.handlers[user] = lambda r: {
            **arc, "merges": [{"facts": [r.number_of(a), r.number_of(b)], "text": merged}]
        }
        await digest(api)
        # Restated outside a pass: the arc then rests on the row that restated it.
        again = f"{user} project Foxtrot now stores its data in Postgres 16"
        (restated, *_) = await store_apply(
            api.store_address, user,
            store_pb2.Op(insert=store_pb2.NewMemory(
                owner=common_pb2.Owner(user_id=user), layer=L3, content=again,
                source_ids=list(more[e].source_ids), ref="n")),
            store_pb2.Op(retire=store_pb2.RetireOp(
                id=more[e].id, superseded_how="restated", superseded_by="$n")),
        )
        f = f"{user} project Foxtrot backs up Postgres nightly"
        _, last = await facts_from_turns(api, user, [(f, 0)], 1)
        script.handlers[user] = lambda r: arc
        await digest(api)
    finally:
        del script.handlers[user]
    assert len(script.calls(user)) == 3
    facts = {m.content: m.id for m in await api.rows(user, "l3_fact", retired=False)}
    (live,) = [s for s in await api.rows(user, "l4_summary") if s.status == "active"]
    assert sorted(live.source_ids) == sorted([facts[merged], restated.id, last[f].id])


async def test_an_arcs_old_evidence_stands_for_the_rows_its_values_were_merged_or_restated_into(
    api: Api,
) -> None:
    user = marker()
    _, rows = await facts_from_turns(
        api, user, [(f"{user} {n}", 0) for n in ("kept", "merged", "restated", "dropped")], 1
    )
    kept, merged, restated, dropped = (rows[f"{user} {n}"].id for n in (
        "kept", "merged", "restated", "dropped"))

    def retire(memory_id: str, how: str, by: str = "") -> store_pb2.Op:
        return store_pb2.Op(retire=store_pb2.RetireOp(
            id=memory_id, superseded_how=how, superseded_by=by))

    def merge(text: str) -> store_pb2.Op:
        op = new(user, L3, text)
        op.insert.ref = "m"
        return op

    (first, *_) = await store_apply(
        api.store_address, user, merge(f"{user} merge one"), retire(merged, "merged", "$m")
    )
    (second, *_) = await store_apply(
        api.store_address, user, merge(f"{user} merge two"),
        retire(first.id, "merged", "$m"), retire(restated, "restated", "$m"),
        retire(dropped, "dropped"),
    )
    async with open_channel(api.store_address) as channel:
        got = await standing(
            GraphStoreClient(channel), common_pb2.Scope(user_id=user),
            [kept, merged, restated, dropped, kept, "no-such-row"],
        )
    assert got == [kept, second.id]


async def test_admin_dedupe_and_compact_dry_run_first_then_change(
    tmp_path: Path, embedder_address: str
) -> None:
    env = {
        "HYATLAS_EMBEDDER_ADDR": embedder_address,
        "HYATLAS_MODE": "ultra",
        "HYATLAS_ADMIN": "on",
    }
    with running_stack(tmp_path, STACK, **env) as stack:
        api = Api(stack.base_url, stack.address("store"))
        user = marker()
        older, newer = f"{user} lives in Lisbon", f"{user} lives in Lisbon."
        await facts_from_turns(api, user, [(older, 0), (newer, 1)], 2)
        long_turn = "USER: hello\n\nTOOL: " + "x" * 50 + "\n\nASSISTANT: " + "y" * 5000
        await store_apply(api.store_address, user, new(user, L2, long_turn))

        dry = await api.ok("POST", "/api/v1/admin/dedupe_facts", json={})
        assert dry["dry_run"] is True and dry["duplicates"] == 1 and dry["rows_superseded"] == 0
        assert all(r.status == "active" for r in await api.rows(user, "l3_fact"))
        done = await api.ok("POST", "/api/v1/admin/dedupe_facts", json={"dry_run": False})
        assert done["rows_superseded"] == 1
        rows = {r.content: r for r in await api.rows(user, "l3_fact")}
        assert (rows[older].superseded_how, rows[older].superseded_by) == (
            "restated",
            rows[newer].id,
        )

        compact = await api.ok("POST", "/api/v1/admin/compact_raw", json={})
        assert compact["dry_run"] is True and compact["rows_changed"] == 1
        assert compact["bytes_after"] < compact["bytes_before"]
        status, body = await api.call("GET", "/api/v1/admin/compact_raw")
        assert status == 405


async def test_admin_dedupe_retires_the_profile_mirror_of_the_fact_it_retires(
    tmp_path: Path, embedder_address: str
) -> None:
    env = {"HYATLAS_EMBEDDER_ADDR": embedder_address, "HYATLAS_MODE": "ultra",
           "HYATLAS_ADMIN": "on"}
    with running_stack(tmp_path, STACK, **env) as stack:
        api = Api(stack.base_url, stack.address("store"))
        user = marker()
        older, newer = f"{user} prefers tea to coffee", f"{user} prefers tea over coffee"
        for text in (older, newer):
            op = new(user, L3, text)
            op.insert.label = "user_preferences"
            await store_apply(api.store_address, user, op)
        assert sorted(m.content for m in await api.rows(user, "l1_profile")) == sorted(
            [older, newer])

        done = await api.ok("POST", "/api/v1/admin/dedupe_facts", json={"dry_run": False})
        assert done["rows_superseded"] == 1
        mirrors = {m.content: m for m in await api.rows(user, "l1_profile")}
        assert (mirrors[older].status, mirrors[older].superseded_how) == ("retired", "restated")
        assert mirrors[newer].status == "active"


async def test_raw_retention_deletes_only_old_raw_rows_nothing_cites(
    tmp_path: Path, embedder_address: str, fake: FakeLlm
) -> None:
    env = ultra_env(fake, embedder_address, HYATLAS_RAW_RETENTION="1s")
    with running_stack(tmp_path, STACK, **env) as stack:
        api = Api(stack.base_url, stack.address("store"))
        user = marker()
        raw_ids, _ = await facts_from_turns(api, user, [(f"{user} owns a red bike", 0)], 2)
        cited, uncited = raw_ids

        async def pruned() -> None:
            report = await digest(api)
            assert report["pruned_raw"] == 1 and report["protected_raw"] == 1

        await assert_eventually(pruned, interval_s=0.3)
        assert [r.id for r in await api.rows(user, "l2_raw")] == [cited]
        assert uncited not in {r.id for r in await api.rows(user, "l2_raw")}


async def test_raw_retention_keeps_turns_whose_extraction_is_not_over(
    tmp_path: Path, embedder_address: str, fake: FakeLlm
) -> None:
    env = ultra_env(fake, embedder_address, HYATLAS_RAW_RETENTION="1s")
    with running_stack(tmp_path, STACK, **env) as stack:
        api = Api(stack.base_url, stack.address("store"))
        user = marker()
        statuses = ["", "pending", "failed", "unconfigured", "skipped", "done"]
        ops = [new(user, L2, f"{user} turn {status}") for status in statuses]
        for op, status in zip(ops, statuses, strict=True):
            op.insert.extraction_status = status
        rows = dict(zip(statuses, await store_apply(api.store_address, user, *ops), strict=True))

        async def pruned() -> None:
            assert (await digest(api))["pruned_raw"] > 0

        await assert_eventually(pruned, interval_s=0.3)
        kept = {r.id for r in await api.rows(user, "l2_raw")}
        # A lite-mode turn ("skipped") was never extracted: it is all there is of its memory;
        # nor is one that says nothing of its extraction ("") known to have been.
        assert kept == {rows[s].id for s in ("", "pending", "failed", "unconfigured", "skipped")}


async def test_raw_retention_keeps_rows_cited_only_by_edges_past_the_newest_thousand(
    tmp_path: Path, embedder_address: str, fake: FakeLlm
) -> None:
    env = ultra_env(fake, embedder_address, HYATLAS_RAW_RETENTION="1s")
    with running_stack(tmp_path, STACK, **env) as stack:
        api = Api(stack.base_url, stack.address("store"))
        user = marker()
        rows = await store_apply(
            api.store_address, user, *(extracted_turn(user, f"{user} turn {n}") for n in range(5))
        )
        first_a, first_b, later_a, later_b, uncited = (r.id for r in rows)

        def edge(n: int, sources: list[str]) -> store_pb2.Op:
            return store_pb2.Op(put_edge=store_pb2.PutEdgeOp(
                owner=common_pb2.Owner(user_id=user), subject=f"thing {n}",
                relation="relates to", object=f"other {n}", source_ids=sources))

        # The first edge is the only one citing first_a and first_b; 1,001 newer edges follow,
        # so it lies beyond the newest 1,000 that one page of ListEdges holds.
        await store_apply(api.store_address, user, edge(0, [first_a, first_b]))
        await store_apply(
            api.store_address, user, *(edge(n, [later_a, later_b]) for n in range(1, 1002))
        )

        async def pruned() -> None:
            report = await digest(api)
            assert report["pruned_raw"] == 1 and report["protected_raw"] == 4, report

        await assert_eventually(pruned, interval_s=0.3)
        kept = {r.id for r in await api.rows(user, "l2_raw")}
        assert kept == {first_a, first_b, later_a, later_b} and uncited not in kept


async def test_edges_link_memories_of_one_session_and_each_to_its_nearest(api: Api) -> None:
    user, other = marker(), marker()

    def fact(text: str, session: str) -> store_pb2.Op:
        op = new(user, L3, f"{user} {text}")
        op.insert.owner.session_id = session
        return op

    rows = await store_apply(
        api.store_address,
        user,
        fact("drinks green tea every morning", "s1"),
        fact("repairs old road bikes in the garage", "s1"),
        fact("prefers green tea to coffee", "s1"),
        fact("fixes bicycles for neighbours", "s2"),
    )
    tea, bikes, tea_again, fixes = (r.id for r in rows)
    (raw,) = await store_apply(api.store_address, user, new(user, L2, f"{user} a raw turn"))
    body = await api.ok("GET", "/api/v1/edges", params={"user_id": user, "k_semantic": 1})
    pairs = [(e["from"], e["to"], e["session_id"]) for e in body["co_session"]]
    assert pairs == [(tea, bikes, "s1"), (bikes, tea_again, "s1")]
    nearest = {e["from"]: e["to"] for e in body["semantic"]}
    assert nearest == {tea: tea_again, tea_again: tea, bikes: fixes, fixes: bikes}
    assert all(e["relation"] == "semantic" and 0 < e["weight"] <= 1 for e in body["semantic"])
    memory_nodes = {n["id"] for n in body["nodes"] if n["type"] == "memory"}
    assert memory_nodes == {tea, bikes, tea_again, fixes} and raw.id not in memory_nodes

    assert body["total_memories"] == 4
    none = await api.ok("GET", "/api/v1/edges", params={"user_id": user, "k_semantic": 0})
    assert none["semantic"] == [] and len(none["co_session"]) == 2
    # Fewer nodes than memories: the reply says how many there are.
    newest = await api.ok("GET", "/api/v1/edges", params={"user_id": user, "n": 2})
    assert len([n for n in newest["nodes"] if n["type"] == "memory"]) == 2
    assert newest["total_memories"] == 4
    # The store refuses to link memories outside the scope.
    async with open_channel(api.store_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await store_pb2_grpc.StoreStub(channel).Neighbours(
                store_pb2.NeighboursRequest(
                    scope=common_pb2.Scope(user_id=other), ids=[tea, bikes], k=1
                ),
                timeout=10,
            )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND




async def test_a_digest_with_a_malformed_body_is_refused_and_runs_no_pass(api: Api) -> None:
    runs = (await api.ok("GET", "/api/v1/digest"))["runs"]
    status, body = await api.call("POST", "/api/v1/digest", data=b"{bad",
                                  headers={"Content-Type": "application/json"})
    assert (status, body["error"]) == (400, "bad body"), body
    assert (await api.ok("GET", "/api/v1/digest"))["runs"] == runs
