"""The consolidator's pure parts: clusters, the reply checks, the prompt with the graph off."""

from __future__ import annotations

import numpy as np
import pytest

from services.consolidator.admin import compact_turn
from services.consolidator.clusters import Cluster, assign, rebuilt
from services.consolidator.plan import PartialReply, read_patterns, read_plan
from services.consolidator.prompt import consolidation_messages, reply_keys
from shared.pb import common_pb2

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
    plan = read_plan(reply, KEYS, [["t1"], ["t2"]], 0)
    assert [d.fact for d in plan.drops] == [1]
    assert any("not shown" in why for why in plan.refused)


def test_a_drop_needs_a_reason_and_a_fact_is_used_once() -> None:
    reply = {
        **FULL,
        "merges": [{"facts": [1, 2], "text": "x"}],
        "drops": [{"fact": 1, "reason": "dup"}, {"fact": 3}],
    }
    plan = read_plan(reply, KEYS, [["t1"], ["t2"], ["t3"]], 0)
    assert len(plan.merges) == 1 and plan.drops == []
    assert len(plan.refused) == 2


def test_an_edge_from_one_turn_is_refused_and_from_two_kept() -> None:
    edge = {"subject": "A", "relation": "uses", "object": "B"}
    reply = {**FULL, "edges": [{**edge, "facts": [1, 2]}, {**edge, "facts": [2, 3]}]}
    plan = read_plan(reply, KEYS, [["t1"], ["t1"], ["t2"]], 0)
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
        read_plan(reply, KEYS, [["t1"], ["t2"]], 0)


def test_with_the_graph_off_the_prompt_asks_for_no_edges_and_no_arc() -> None:
    fact = common_pb2.Memory(id="secret-id", content="Alice uses Postgres", created_at=0)
    messages = consolidation_messages([fact], [], [], arc="", graph=False)
    text = "\n".join(m["content"] for m in messages)
    assert "edges" not in text and "arc" not in text and "secret-id" not in text
    assert reply_keys(graph=False, arc=False) == ["merges", "drops", "schemas"]
    assert "[1] (1970-01-01) Alice uses Postgres" in text


def test_cross_topic_patterns_need_two_shown_schemas() -> None:
    reply = {"patterns": [{"text": "p", "schemas": [1, 2]}, {"text": "q", "schemas": [1, 9]}]}
    kept, refused = read_patterns(reply, 3)
    assert kept == [("p", (0, 1))] and len(refused) == 1


def test_compacting_a_turn_keeps_user_and_assistant_capped() -> None:
    turn = "USER: hi\n\nTOOL: " + "x" * 10 + "\n\nASSISTANT: " + "y" * 5000
    compacted = compact_turn(turn)
    assert "TOOL" not in compacted and compacted.startswith("USER: hi")
    assert len(compacted.encode()) < 4100
