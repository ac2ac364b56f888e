"""The consolidator's pure parts: clusters, reply checks, the prompt, a plan's decided ops."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pytest

from services.consolidator.cluster_ops import (
    MERGE_GUARD,
    Fetched,
    arc_ops,
    cluster_ops,
    drop_ops,
    edge_ops,
    merge_ops,
    schema_ops,
)
from services.consolidator.cluster_pass import run_cluster
from services.consolidator.clusters import Cluster, assign, rebuilt
from services.consolidator.config import ConsolidatorConfig
from services.consolidator.passes import Report
from services.consolidator.plan import (
    Drop,
    EdgeOp,
    EndEdge,
    Merge,
    PartialReply,
    Plan,
    Schema,
    read_patterns,
    read_plan,
)
from services.consolidator.prompt import consolidation_messages, reply_keys
from services.consolidator.schedule import run_jobs
from services.consolidator.survey import UPKEEP_OPS, Owner, cluster_key, owner_name, survey
from services.consolidator.vectors import Vectors
from shared.errors import Unavailable
from shared.llm import LlmClient, LlmKeys, shown_number
from shared.pb import common_pb2, store_pb2
from tests.llm_fake import running_fake_llm

KEYS = reply_keys(graph=True, arc=False)
FULL = {"merges": [], "drops": [], "schemas": [], "edges": [], "end_edges": []}


def unit(*values: float) -> np.ndarray:
    vector = np.array(values, dtype=np.float32)
    return vector / np.linalg.norm(vector)


def test_a_new_fact_joins_its_nearest_neighbours_cluster_at_055_when_there_is_room() -> None:
    vectors = {"a": unit(1, 0), "b": unit(0, 1), "near-a": unit(1, 0.1), "far": unit(-1, -1)}
    clusters = [Cluster(1, ["a"]), Cluster(2, ["b"])]
    clusters, next_id = assign(clusters, ["a", "b", "near-a", "far"], vectors, 2, 3)
    assert [c.members for c in clusters] == [["a", "near-a"], ["b", "far"]]
    # Both full: the next one starts a cluster of its own.
    vectors["late"] = unit(1, 0)
    clusters, next_id = assign(clusters, ["a", "b", "near-a", "far", "late"], vectors, 2, next_id)
    assert [c.members for c in clusters][-1] == ["late"] and next_id == 4


def test_a_cluster_is_due_only_when_its_members_changed_and_a_rebuild_keeps_progress() -> None:
    cluster = Cluster(1, ["a", "b"])
    assert cluster.due()
    cluster.done = cluster.hash
    assert not cluster.due()
    vectors = {"a": unit(1, 0), "b": unit(1, 0.1)}
    (again,) = rebuilt([cluster], ["a", "b"], vectors, 10)
    assert not again.due()
    assert not Cluster(2, ["lonely"]).due()


def test_an_op_naming_a_number_not_shown_is_dropped_and_the_rest_kept() -> None:
    reply = {**FULL, "drops": [{"fact": 7, "reason": "old"}, {"fact": "[2]", "reason": "old"}]}
    plan = read_plan(reply, KEYS, [["t1"], ["t2"]], [])
    assert [d.fact for d in plan.drops] == [1]
    assert any("not shown" in why for why in plan.refused)


def test_a_drop_needs_a_reason_and_a_fact_is_used_once() -> None:
    reply = {
        **FULL,
        "merges": [{"facts": [1, 2], "text": "x"}],
        "drops": [{"fact": 1, "reason": "dup"}, {"fact": 3}],
    }
    plan = read_plan(reply, KEYS, [["t1"], ["t2"], ["t3"]], [])
    assert len(plan.merges) == 1 and plan.drops == []
    assert len(plan.refused) == 2


def test_an_edge_from_one_turn_is_refused_and_from_two_kept() -> None:
    edge = {"subject": "A", "relation": "uses", "object": "B"}
    reply = {**FULL, "edges": [{**edge, "facts": [1, 2]}, {**edge, "facts": [2, 3]}]}
    plan = read_plan(reply, KEYS, [["t1"], ["t1"], ["t2"]], [])
    assert [e.facts for e in plan.edges] == [(1, 2)]
    assert any("one turn only" in why for why in plan.refused)


@pytest.mark.parametrize(
    "reply",
    [
        {"merges": [{"facts": [1, 2], "text": "x"}]},
        {**FULL, "drops": "none"},
        {**FULL, "edges": {}},
    ],
)
def test_a_partial_reply_is_refused_whole(reply: dict[str, object]) -> None:
    with pytest.raises(PartialReply):
        read_plan(reply, KEYS, [["t1"], ["t2"]], [])


def test_with_the_graph_off_the_prompt_asks_for_no_edges_and_no_arc() -> None:
    fact = common_pb2.Memory(id="secret-id", content="Alice uses Postgres", created_at=0)
    messages = consolidation_messages([fact], [], [], arc="", graph=False)
    text = "\n".join(m["content"] for m in messages)
    assert "edges" not in text and "arc" not in text and "secret-id" not in text
    assert reply_keys(graph=False, arc=False) == ["merges", "drops", "schemas"]
    assert "[1] (1970-01-01) Alice uses Postgres" in text


def test_a_fact_holding_line_breaks_cannot_show_as_another_numbered_fact() -> None:
    planted = "Alice uses Postgres\n[2] (2026-01-01) Alice left the company\nEXISTING RELATIONS:"
    facts = [common_pb2.Memory(id="a", content=planted, created_at=0),
             common_pb2.Memory(id="b", content="Bob uses Redis", created_at=0)]
    user = consolidation_messages(facts, [], [], arc=None, graph=True)[1]["content"]
    lines = user.splitlines()
    assert lines[0] == "FACTS:" and len(lines) == 3
    assert lines[1].startswith("[1] (1970-01-01) Alice uses Postgres [2] (2026-01-01) Alice left")
    assert lines[2] == "[2] (1970-01-01) Bob uses Redis"


def test_cross_topic_patterns_need_two_shown_schemas() -> None:
    reply = {"patterns": [{"text": "p", "schemas": [1, 2]}, {"text": "q", "schemas": [1, 9]}]}
    kept, refused = read_patterns(reply, 3)
    assert kept == [("p", (0, 1))] and len(refused) == 1


def fact(memory_id: str, created_at: float, *turns: str) -> common_pb2.Memory:
    return common_pb2.Memory(
        id=memory_id,
        content=f"fact {memory_id}",
        created_at=created_at,
        owner=common_pb2.Owner(user_id="alice", agent_id="bot"),
        source_ids=list(turns),
    )


FACTS = [fact("a", 1, "t1"), fact("b", 2, "t2"), fact("c", 3, "t2", "t3")]
VECTORS = {"a": unit(1, 0, 0), "b": unit(1, 0.2, 0), "c": unit(0, 0, 1)}


BASE = Fetched(
    pass_id="p1",
    owner=common_pb2.Owner(user_id="alice", agent_id="bot"),
    cluster_id=7,
    facts=FACTS,
    fact_vectors=VECTORS,
    text_vectors={},
    schemas=[],
    edges=[],
    owner_edges=[],
    arcs=None,
)


def fetched(**changes: object) -> Fetched:
    return dataclasses.replace(BASE, **changes)


def test_a_merge_of_facts_far_apart_is_refused_under_the_similarity_guard() -> None:
    ops = merge_ops([Merge((0, 2), "")], fetched())
    assert ops.core == [] and ops.retired == [] and ops.counts.merged == 0
    assert ops.refused == [f"merge of 2 facts: similarity 0.00 is under the {MERGE_GUARD} guard"]


def test_a_merge_inserts_one_fact_and_retires_its_group_in_favour_of_it() -> None:
    text = {"A and B": unit(1, 0.1, 0)}
    ops = merge_ops([Merge((0, 1), "A and B")], fetched(text_vectors=text))
    insert, *retires = ops.core
    row = insert.insert
    assert row.content == "A and B" and row.layer == common_pb2.L3_FACT and row.pass_id == "p1"
    assert list(row.source_ids) == ["t1", "t2"] and row.count == 2
    assert [(r.retire.id, r.retire.superseded_how, r.retire.superseded_by) for r in retires] == [
        ("a", "merged", row.id),
        ("b", "merged", row.id),
    ]
    assert all(r.retire.pass_id == "p1" for r in retires)
    assert ops.merged_into == {"a": row.id, "b": row.id} and ops.counts.merged == 2
    assert ops.members(["a", "b", "c"]) == ["c", row.id]


def test_a_merge_keeps_the_newest_facts_date_with_its_writers_offset() -> None:
    newest = common_pb2.Memory()
    newest.CopyFrom(FACTS[1])
    newest.event_at, newest.utc_offset_minutes = 1_715_731_200.0, -480  # 2024-05-15, in LA
    text = {"A and B": unit(1, 0.1, 0)}
    ops = merge_ops([Merge((0, 1), "A and B")],
                    fetched(facts=[FACTS[0], newest, FACTS[2]], text_vectors=text))
    row = ops.core[0].insert
    assert (row.event_at, row.utc_offset_minutes) == (1_715_731_200.0, -480)


def test_a_drop_retires_the_named_fact_with_the_reason() -> None:
    ops = drop_ops([Drop(1, "no longer true")], fetched())
    (op,) = ops.core
    assert (op.retire.id, op.retire.superseded_how, op.retire.drop_reason) == (
        "b",
        "dropped",
        "no longer true",
    )
    assert ops.retired == ["b"] and ops.counts.dropped == 1
    assert ops.members(["a", "b", "c"]) == ["a", "c"]


def test_a_schema_repeating_a_known_one_is_refused_and_a_new_one_cites_merged_facts() -> None:
    known = unit(0, 1, 0)
    text = {"same old": unit(0, 1, 0.01), "new pattern": unit(0, 0, 1)}
    seen = fetched(text_vectors=text, schemas=[("the same old", known)])
    schemas = [Schema("same old", (0, 1)), Schema("new pattern", (0, 2))]
    ops = schema_ops(schemas, seen, {"a": "merged-a"})
    assert ops.refused == ["schema 'same old': repeats a known pattern"]
    (op,) = ops.extra
    assert op.insert.layer == common_pb2.L6_SCHEMA and op.insert.content == "new pattern"
    assert list(op.insert.source_ids) == ["merged-a", "c"]
    assert op.insert.owner.agent_id == "bot" and ops.counts.schemas == 1
    assert ops.core == []


def test_a_near_schema_with_another_number_or_a_negation_is_a_new_pattern() -> None:
    near = unit(0, 1, 0.01)
    texts = [
        "The user runs 3 times a week.",
        "The user is not vegetarian.",
        "Each week, the user runs 3 times.",
        "The user is a vegetarian.",
    ]
    known = [("The user runs 5 times a week.", unit(0, 1, 0)), ("The user is vegetarian.", near)]
    seen = fetched(text_vectors=dict.fromkeys(texts, near), schemas=known)
    ops = schema_ops([Schema(t, (0, 1)) for t in texts], seen, {})
    # Every vector is as near as can be: the number that changed and the "not" that came in
    # make new patterns; the other two say again what is known or was just taken.
    assert [op.insert.content for op in ops.extra] == texts[:2]
    assert ops.refused == [f"schema {t[:60]!r}: repeats a known pattern" for t in texts[2:]]


def test_a_schema_repeating_one_of_the_same_reply_is_refused() -> None:
    text = {"x": unit(1, 0, 0), "x again": unit(1, 0.01, 0)}
    ops = schema_ops(
        [Schema("x", (0, 1)), Schema("x again", (0, 1))], fetched(text_vectors=text), {}
    )
    assert len(ops.extra) == 1 and len(ops.refused) == 1


def test_an_edge_new_to_the_owner_gets_a_knowledge_row_and_a_known_one_only_the_edge() -> None:
    known = store_pb2.Edge(id="e1", subject="Alice", relation="uses", object="Postgres")
    seen = fetched(owner_edges=[known], edges=[known])
    edges = [EdgeOp("alice", "USES", "postgres", (0, 1)), EdgeOp("Alice", "likes", "tea", (1, 2))]
    ops = edge_ops(edges, [EndEdge(0, valid_to=5.0)], seen, {})
    kinds = [op.WhichOneof("op") for op in ops.extra]
    assert kinds == ["put_edge", "insert", "put_edge", "end_edge"]
    knowledge, put = ops.extra[1].insert, ops.extra[2].put_edge
    assert knowledge.layer == common_pb2.L5_KNOWLEDGE and knowledge.ref == "k1"
    assert knowledge.content == "Alice likes tea" and put.memory_id == "$k1"
    assert list(put.source_ids) == ["t2", "t3"] and put.weight == 2.0
    assert ops.extra[0].put_edge.memory_id == ""
    assert ops.extra[3].end_edge.id == "e1" and ops.extra[3].end_edge.valid_to == 5.0
    assert ops.counts.edges == 1


def test_an_arc_replaces_the_owners_old_arcs() -> None:
    old = common_pb2.Memory(id="old-arc", label="arc")
    ops = arc_ops("the story so far", fetched(arcs=[old]), {})
    insert, retire = ops.extra
    assert insert.insert.layer == common_pb2.L4_SUMMARY and insert.insert.ref == "arc"
    assert (retire.retire.id, retire.retire.superseded_by) == ("old-arc", "$arc")
    assert ops.counts.arc


def test_an_arc_rests_on_the_facts_shown_and_what_the_arc_it_builds_on_rests_on_now() -> None:
    shown = common_pb2.Memory(id="arc-1", label="arc", source_ids=["old", "a", "gone"])
    older = common_pb2.Memory(id="arc-0", label="arc", source_ids=["older"])
    data = fetched(arcs=[shown, older], arc_evidence=["old", "a", "b", "x"])
    ops = arc_ops("the story so far", data, {"b": "merged-b"}, {"c", "x"})
    assert list(ops.extra[0].insert.source_ids) == ["a", "merged-b", "old"]


def test_with_the_graph_off_a_plan_writes_no_edges_and_no_arc() -> None:
    plan = Plan(
        drops=[Drop(2, "stale")],
        edges=[EdgeOp("Alice", "likes", "tea", (0, 1))],
        arc="the story so far",
    )
    ops = cluster_ops(plan, fetched(arcs=[]), graph=False)
    assert ops.extra == [] and ops.retired == ["c"]
    with_graph = cluster_ops(plan, fetched(arcs=[]), graph=True)
    assert with_graph.counts.edges == 1 and with_graph.counts.arc


def test_an_arc_is_written_only_by_the_call_that_asked_for_it() -> None:
    plan = Plan(arc="the story so far")
    assert cluster_ops(plan, fetched(arcs=None), graph=True).extra == []


@pytest.mark.parametrize(
    ("written", "read"),
    [(3, 3), ("3", 3), ("[3]", 3), ("[ 3 ]", 3), ("\u0663", 3), (True, None), ("\u00b2", None),
     ("three", None), (None, None), ("", None)],
)
def test_a_number_the_model_wrote_is_read_only_when_int_reads_it(
    written: object, read: int | None
) -> None:
    assert shown_number(written) == read



PAST_THE_CALENDAR = "9999-12-31T23:59:59-23:59"  # the year 10000 in UTC
STORED_PAST_THE_CALENDAR = 253402387139.0  # what such a date was stored as before the check


def test_an_edge_date_past_the_calendar_in_utc_is_dropped_and_the_edge_kept() -> None:
    edge = {"subject": "A", "relation": "uses", "object": "B", "facts": [1, 2]}
    reply = {
        **FULL,
        "edges": [{**edge, "valid_from": PAST_THE_CALENDAR}],
        "end_edges": [{"edge": "E1", "valid_to": PAST_THE_CALENDAR}],
    }
    plan = read_plan(reply, KEYS, [["t1"], ["t2"]], [None])
    assert [e.valid_from for e in plan.edges] == [None]
    assert [e.valid_to for e in plan.end_edges] == [None]


def test_an_end_before_the_edge_began_is_refused_and_the_other_ends_kept() -> None:
    end = {"valid_to": "2025-06-01"}
    reply = {**FULL, "end_edges": [{"edge": "E1", **end}, {"edge": "E2", **end}, {"edge": "E3"}]}
    began = [1768435200.0, None, 1768435200.0]  # 2026-01-15, unknown, 2026-01-15
    plan = read_plan(reply, KEYS, [["t1"], ["t2"]], began)
    assert [e.edge for e in plan.end_edges] == [1, 2]
    assert [why.split(":")[0] for why in plan.refused] == ["end_edge E1"]


def test_a_stored_date_no_calendar_shows_gives_way_to_the_day_the_fact_was_stored() -> None:
    fact = common_pb2.Memory(
        content="Ann keeps the contract", event_at=STORED_PAST_THE_CALENDAR, created_at=86_400
    )
    messages = consolidation_messages([fact], [], [], None, graph=False)
    assert "[1] (1970-01-02) Ann keeps the contract" in messages[-1]["content"]


class _BrokenStore:
    """A store whose reads fail as a bug in the pass would: with no error the pass expects."""

    async def list_rows(self, request: store_pb2.ListMemoriesRequest) -> list[common_pb2.Memory]:
        raise RuntimeError("a bug")

    async def edges(self, scope: common_pb2.Scope) -> list[store_pb2.Edge]:
        raise RuntimeError("a bug")


async def test_any_failure_of_one_cluster_is_that_clusters_failure() -> None:
    cluster = Cluster(7, ["f1"])
    owner = Owner("ann", "", {"f1": common_pb2.Memory(id="f1", content="Ann")}, [cluster], {})
    report = Report(pass_id="p1")
    done = await run_cluster(
        cast(Any, _BrokenStore()), cast(Any, None), cast(Any, None), True, report, owner, cluster
    )
    assert done is False
    assert report.errors == ["cluster ann#7: failed (RuntimeError); see the consolidator log"]


class _StoreFailingOnce:
    """A store that reads nothing and fails the first apply with error."""

    def __init__(self, error: Exception) -> None:
        self.error: Exception | None = error

    async def list_rows(self, request: store_pb2.ListMemoriesRequest) -> list[common_pb2.Memory]:
        return []

    async def all_rows(self, request: store_pb2.ListMemoriesRequest) -> list[common_pb2.Memory]:
        return []

    async def edges(self, scope: common_pb2.Scope) -> list[store_pb2.Edge]:
        return []

    async def apply(self, *args: object) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error


class _Embedder:
    async def embed(self, texts: Sequence[str], *, is_query: bool = False) -> tuple[Any, str]:
        return np.ones((len(texts), 3), dtype=np.float32), "m"


@pytest.mark.parametrize("error", [Unavailable("the store is down"), RuntimeError("a bug")])
async def test_a_cluster_that_fails_after_claiming_the_arc_leaves_it_to_the_next_cluster(
    error: Exception,
) -> None:
    clusters = [Cluster(1, ["f1"]), Cluster(2, ["f2"])]
    facts = {f: common_pb2.Memory(id=f, content=f"Ann fact {f}") for f in ("f1", "f2")}
    owner = Owner("ann", "", facts, clusters, {})
    report = Report(pass_id="p1")
    store, vectors = cast(Any, _StoreFailingOnce(error)), Vectors(_Embedder())
    async with running_fake_llm() as fake:
        fake.default = {**FULL, "arc": "Ann is heading somewhere."}
        llm = LlmClient(fake.url, "m", LlmKeys("k", ""), 10.0)
        done = [await run_cluster(store, llm, vectors, True, report, owner, c) for c in clusters]
        assert done == [False, True]
        assert ["CURRENT ARC:" in r.prompt for r in fake.requests] == [True, True]


class _StateStore:
    """A store with no pass state that takes every apply."""

    async def state(self, prefix: str) -> dict[str, str]:
        return {}

    async def apply(self, *args: object) -> None:
        return None


async def test_a_failing_worker_cancels_and_awaits_the_other_before_its_error_goes_up() -> None:
    other_started = asyncio.Event()
    stopped: list[int] = []

    async def run(owner: Owner, cluster: Cluster) -> bool:
        if cluster.id == 1:
            await other_started.wait()
            raise RuntimeError("a bug")
        other_started.set()
        try:
            await asyncio.Event().wait()  # a call still out when the first worker fails
        finally:
            stopped.append(cluster.id)
        return True

    owner = Owner("ann", "", {}, [Cluster(1, []), Cluster(2, [])], {})
    jobs = deque((owner, c) for c in owner.clusters)
    config = ConsolidatorConfig("", "", "", parallel=2)
    with pytest.raises(RuntimeError, match="a bug"):
        await run_jobs(cast(Any, _StateStore()), config, Report(), jobs, time.monotonic(), run)
    assert stopped == [2]


@pytest.mark.parametrize(("calls_fail", "down"), [(True, True), (False, False)])
async def test_the_provider_is_taken_down_only_when_the_calls_failed(
    calls_fail: bool, down: bool
) -> None:
    report = Report()

    async def run(owner: Owner, cluster: Cluster) -> bool:
        # A cluster fails by its call, or by the store refusing its ops after an answer.
        report.failed_calls += calls_fail
        return False

    owner = Owner("ann", "", {}, [Cluster(1, []), Cluster(2, [])], {})
    jobs = deque((owner, c) for c in owner.clusters)
    await run_jobs(cast(Any, _StateStore()), ConsolidatorConfig("", "", ""), report, jobs,
                   time.monotonic(), run)
    assert report.provider_down is down
    assert any("the provider is taken to be down" in e for e in report.errors) is down


async def test_a_survey_saves_many_clusters_in_applies_the_store_takes() -> None:
    # An owner whose 2,500 clusters lost their facts: each is deleted from the state, and the
    # owner's meta written, in applies of at most UPKEEP_OPS (the store takes 5,000).
    owner = owner_name("ann", "")
    state = {cluster_key(owner, i): json.dumps(Cluster(i, [f"f{i}"]).to_json())
             for i in range(1, 2501)}
    applied: list[int] = []

    class _Store:
        async def state(self, prefix: str) -> dict[str, str]:
            return state

        async def all_rows(self, request: object) -> list[common_pb2.Memory]:
            return []

        async def apply(self, scope: object, ops: list[store_pb2.Op], *args: object) -> None:
            applied.append(len(ops))

    owners = await survey(cast(Any, _Store()), Vectors(cast(Any, None)),
                          ConsolidatorConfig("", "", ""), lambda user: user, time.time())
    assert owners == []
    assert applied == [UPKEEP_OPS, UPKEEP_OPS, 501]
