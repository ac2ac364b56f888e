"""Graph-assisted recall and the facts behind schemas: units, then real store/search processes."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from gateway.shapes import search_item
from services.search.engine import SearchEngine
from services.search.graph import (
    GRAPH_SHARE,
    MAX_GRAPH_MEMORIES,
    GraphEdge,
    graph_names,
    join_graph,
    linked_memory_ids,
)
from services.search.model import Candidate, Scope, SearchContext, SearchQuery
from services.search.pipeline import LITE_PIPELINE
from services.search.switches import switchable_names
from shared.pb import common_pb2, search_pb2, search_pb2_grpc, store_pb2, store_pb2_grpc
from tests.support import Stack, running_stack

# -- units ---------------------------------------------------------------------------------


def query(
    text: str, *, layers: Sequence[str] = (), skip: Sequence[str] = (), reader: str = ""
) -> SearchQuery:
    return SearchQuery.build(
        scope=Scope("alice"),
        text=text,
        limit=5,
        layers=layers,
        min_score=None,
        default_min_score=None,
        reader=reader,
        skip_stages=skip,
    )


def memory(
    memory_id: str, layer: str = "l3_fact", fused: float = 0.0, **extra: object
) -> Candidate:
    candidate = Candidate(memory_id=memory_id, layer=layer, content=f"text of {memory_id}", **extra)  # type: ignore[arg-type]
    candidate.fused = fused
    candidate.payload = common_pb2.ScoredMemory(
        memory=common_pb2.Memory(id=memory_id, content=candidate.content)
    )
    return candidate


def test_edges_touching_a_named_node_give_their_memory_and_evidence_ids_ignoring_case() -> None:
    edges = [
        GraphEdge("Priya", "Tomas", ("f1", "f2"), "e1"),
        GraphEdge("Bob", "priya", ("f3",), "e2"),
        GraphEdge("Bob", "Paris", ("f4",), "e3"),
    ]
    assert linked_memory_ids(edges, ["PRIYA"]) == ["e1", "f1", "f2", "e2", "f3"]
    assert linked_memory_ids(edges, ["Nobody"]) == []
    assert linked_memory_ids(edges, []) == []
    # Case-folded as the store folds edge names: ß is ss, as in its capital form.
    assert linked_memory_ids([GraphEdge("Strauß", "Wien", (), "e4")], ["STRAUSS"]) == ["e4"]


def test_node_labels_count_as_names_in_any_case() -> None:
    edges = [GraphEdge("Lake Tahoe", "Priya")]
    assert set(graph_names("trips to lake tahoe?", edges)) >= {"Lake Tahoe"}
    assert graph_names("what about lunch", edges) == []


def test_linked_ids_are_capped() -> None:
    edges = [GraphEdge("Ann", f"n{i}", (f"f{i}",), f"e{i}") for i in range(50)]
    assert len(linked_memory_ids(edges, ["ann"])) == MAX_GRAPH_MEMORIES


def ctx(text: str, graph: list[Candidate], **query_args: object) -> SearchContext:
    return SearchContext(
        query=query(text, **query_args),  # type: ignore[arg-type]
        vector=[],
        keyword=[],
        now=0.0,
        intention_ttl_s=None,
        graph=graph,
    )


def test_graph_memories_join_below_the_best_direct_hit_and_boost_ones_already_found() -> None:
    ranked = [memory("a", fused=1.0), memory("b", fused=0.4)]
    out = join_graph(ranked, ctx("Priya?", [memory("new"), memory("b")]))
    assert [c.memory_id for c in out] == ["a", "new", "b"]
    assert out[1].fused == pytest.approx(GRAPH_SHARE)
    assert out[1].graph
    assert out[2].fused == pytest.approx(0.44)


def test_graph_memories_outside_the_asked_layers_stay_out() -> None:
    found = join_graph(
        [], ctx("Priya?", [memory("edge", layer="l5_knowledge")], layers=["l3_fact"])
    )
    assert found == []


def test_graph_is_a_switchable_stage_right_after_fusion() -> None:
    assert LITE_PIPELINE.names[:2] == ("fuse", "graph")
    assert "graph" in switchable_names()


class FakeBackend:
    """Answers from fixed rows and counts the calls that reach the graph."""

    def __init__(self, edges: list[GraphEdge], rows: list[Candidate], hits: list[Candidate]):
        self.edges = edges
        self.rows = {r.memory_id: r for r in rows}
        self.hits = hits
        self.edge_calls = 0
        self.cosines_asked: list[list[str]] = []

    async def embed_query(self, text: str) -> tuple[Sequence[float], str]:
        return [1.0], "m"

    async def vector_search(self, scope, vector, model_id, layers, k):  # type: ignore[no-untyped-def]
        return []

    async def cosines(
        self, scope: Scope, vector: Sequence[float], model_id: str, ids: Sequence[str]
    ) -> dict[str, float]:
        self.cosines_asked.append(list(ids))
        return {i: 0.25 for i in ids if i in self.rows}

    async def keyword_search(self, scope, text, layers, k, *, relaxed=False, context=False):  # type: ignore[no-untyped-def]
        out = []
        for hit in self.hits:
            hit.keyword_score, hit.keyword_fraction, hit.strict = 1.0, 1.0, True
            out.append(hit)
        return out, []

    async def newest(self, scope, layers, k, label=""):  # type: ignore[no-untyped-def]
        return []

    async def live_edges(self, scope: Scope, limit: int) -> list[GraphEdge]:
        self.edge_calls += 1
        return self.edges

    async def memories(self, scope: Scope, ids: Sequence[str]) -> list[Candidate]:
        # Copies, as the store's replies are: a search gives its candidates scores.
        return [copy.copy(self.rows[i]) for i in ids if i in self.rows]


def engine(backend: FakeBackend, graph_recall: bool = True) -> SearchEngine:
    return SearchEngine(
        backend, LITE_PIPELINE, intention_ttl_s=None, now_pages=False, graph_recall=graph_recall
    )


def ids(result_channels: dict[str, list[Candidate]]) -> list[str]:
    return [c.memory_id for items in result_channels.values() for c in items]


async def test_engine_finds_a_fact_only_the_graph_connects_to_the_named_entity() -> None:
    backend = FakeBackend(
        [GraphEdge("Priya", "Tomas", ("f1",), "")], [memory("f1")], [memory("hit")]
    )
    result = await engine(backend).search(query("what does Priya like"))
    assert ids(result.channels) == ["hit", "f1"]
    skipped = await engine(backend).search(query("what does Priya like", skip=["graph"]))
    assert ids(skipped.channels) == ["hit"]


async def test_a_memory_only_the_graph_found_shows_its_cosine_with_the_query() -> None:
    backend = FakeBackend(
        [GraphEdge("Priya", "Tomas", ("f1", "gone"), "")], [memory("f1")], [memory("hit")]
    )
    result = await engine(backend).search(query("what does Priya like"))
    found = {c.memory_id: c for items in result.channels.values() for c in items}
    assert found["f1"].score == 0.25
    assert backend.cosines_asked == [["f1"]]
    # The keyword reader embeds no query: nothing to give a cosine against.
    keyword = await engine(backend).search(query("what does Priya like", reader="keyword"))
    assert [c.score for items in keyword.channels.values() for c in items] == [1.0, 0.0]
    assert backend.cosines_asked == [["f1"]]


async def test_lite_mode_and_a_skipped_graph_stage_make_no_edge_call() -> None:
    backend = FakeBackend([GraphEdge("Priya", "Tomas", ("f1",), "")], [memory("f1")], [])
    await engine(backend, graph_recall=False).search(query("what does Priya like"))
    await engine(backend).search(query("what does Priya like", skip=["graph"]))
    assert backend.edge_calls == 0


async def test_a_node_label_counts_in_any_case_and_an_unnamed_node_adds_nothing() -> None:
    backend = FakeBackend(
        [GraphEdge("Priya", "Tomas", ("f1",), "")], [memory("f1")], [memory("hit")]
    )
    lower = await engine(backend).search(query("what does priya like"))
    assert ids(lower.channels) == ["hit", "f1"]
    other = await engine(backend).search(query("what does Bob like"))
    assert ids(other.channels) == ["hit"]


async def test_a_schema_in_the_profile_channel_carries_its_live_evidence_facts() -> None:
    schema = memory("s1", layer="l6_schema", source_ids=("f1", "gone", "f2"))
    backend = FakeBackend([], [memory("f1"), memory("f2")], [schema])
    result = await engine(backend).search(query("hobbies"))
    [shown] = result.channels["profile"]
    assert [e.memory_id for e in shown.evidence] == ["f1", "f2"]


def test_gateway_shows_evidence_as_ids_and_contents() -> None:
    scored = common_pb2.ScoredMemory(
        memory=common_pb2.Memory(id="s1", layer=common_pb2.L6_SCHEMA, content="pattern"),
        evidence=[common_pb2.Memory(id="f1", content="a fact")],
    )
    assert search_item(scored)["evidence"] == [{"memory_id": "f1", "content": "a fact"}]
    assert "evidence" not in search_item(common_pb2.ScoredMemory(memory=scored.memory))


# -- through real processes ------------------------------------------------------------------


def owner() -> common_pb2.Owner:
    return common_pb2.Owner(user_id="alice", agent_id="hermes", session_id="s0")


def insert(layer: int, content: str, **extra: object) -> store_pb2.Op:
    return store_pb2.Op(
        insert=store_pb2.NewMemory(owner=owner(), layer=layer, content=content, **extra)  # type: ignore[arg-type]
    )


def apply(stack: Stack, ops: list[store_pb2.Op]) -> list[common_pb2.Memory]:
    with grpc.insecure_channel(stack.address("store")) as channel:
        reply = store_pb2_grpc.StoreStub(channel).Apply(
            store_pb2.ApplyRequest(scope=common_pb2.Scope(user_id="alice"), ops=ops, actor="api"),
            timeout=60,
        )
    return list(reply.memories)


def search(stack: Stack, text: str, **fields: object) -> search_pb2.SearchMemoriesResponse:
    with grpc.insecure_channel(stack.address("search")) as channel:
        return search_pb2_grpc.SearchStub(channel).SearchMemories(
            search_pb2.SearchMemoriesRequest(
                scope=common_pb2.Scope(user_id="alice"),
                query=text,
                **fields,  # type: ignore[arg-type]
            ),
            timeout=30,
        )


def found(reply: search_pb2.SearchMemoriesResponse) -> list[common_pb2.ScoredMemory]:
    return [item for channel in reply.channels for item in channel.items]


@pytest.fixture(scope="module")
def graph_stack(
    store_backend: str,
    tmp_path_factory: pytest.TempPathFactory, embedder_address: str
) -> Iterator[tuple[Stack, dict[str, str]]]:
    """A pro-mode store and search holding facts, one L5 edge and one L6 schema."""
    data_dir: Path = tmp_path_factory.mktemp("graph")
    with running_stack(
        data_dir, ["store", "search"], HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_MODE="pro"
    ) as stack:
        turn1, turn2, painting, pottery, other = apply(
            stack,
            [
                insert(common_pb2.L2_RAW, "Priya said Tomas is her closest friend."),
                insert(common_pb2.L2_RAW, "Tomas told me she paints sunsets in watercolour."),
                insert(common_pb2.L3_FACT, "Tomas paints sunsets in watercolour every weekend."),
                insert(common_pb2.L3_FACT, "Tomas throws pottery bowls at a studio."),
                insert(common_pb2.L3_FACT, "The office printer jams on Mondays."),
            ],
        )
        edge_memory, _ = apply(
            stack,
            [
                insert(common_pb2.L5_KNOWLEDGE, "Priya is close friends with Tomas.", ref="e"),
                store_pb2.Op(
                    put_edge=store_pb2.PutEdgeOp(
                        owner=owner(),
                        subject="Priya",
                        relation="friend_of",
                        object="Tomas",
                        source_ids=[turn1.id, turn2.id],
                        fact_ids=[painting.id],
                        memory_id="$e",
                        weight=1.0,
                    )
                ),
            ],
        )
        [schema] = apply(
            stack,
            [
                insert(
                    common_pb2.L6_SCHEMA,
                    "The user's friends spend weekends on creative hobbies.",
                    source_ids=[painting.id, pottery.id],
                )
            ],
        )
        yield (
            stack,
            {
                "painting": painting.id,
                "pottery": pottery.id,
                "other": other.id,
                "edge": edge_memory.id,
                "schema": schema.id,
            },
        )


def test_a_fact_sharing_no_words_with_the_query_is_found_through_the_named_entitys_edge(
    graph_stack: tuple[Stack, dict[str, str]],
) -> None:
    stack, ids = graph_stack
    # A cosine floor no hit reaches leaves keywords as the only direct source: "Priya" is in
    # the edge memory, nowhere in the painting fact.
    reply = search(stack, "What does priya enjoy?", min_score=0.99, limit=10)
    shown = [item.memory.id for item in found(reply)]
    assert ids["painting"] in shown
    assert ids["edge"] in shown
    assert ids["other"] not in shown
    # Found by the graph alone, it shows its cosine with the query (it showed 0).
    (painting,) = [item for item in found(reply) if item.memory.id == ids["painting"]]
    assert 0.0 < abs(painting.score) < 0.99
    skipped = search(
        stack, "What does priya enjoy?", min_score=0.99, limit=10, skip_stages=["graph"]
    )
    assert ids["painting"] not in [item.memory.id for item in found(skipped)]


def test_a_schema_in_the_profile_channel_carries_its_evidence_facts(
    graph_stack: tuple[Stack, dict[str, str]],
) -> None:
    stack, ids = graph_stack
    reply = search(stack, "creative hobbies", reader="keyword")
    [profile] = [c for c in reply.channels if c.name == "profile"]
    [item] = [i for i in profile.items if i.memory.id == ids["schema"]]
    assert [(e.id, e.content) for e in item.evidence] == [
        (ids["painting"], "Tomas paints sunsets in watercolour every weekend."),
        (ids["pottery"], "Tomas throws pottery bowls at a studio."),
    ]
    assert not any(i.evidence for i in found(reply) if i.memory.id != ids["schema"])
