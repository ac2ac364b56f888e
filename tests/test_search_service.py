"""The search service through real gRPC, with the real store and embedder processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from shared.pb import common_pb2, search_pb2, search_pb2_grpc, store_pb2, store_pb2_grpc
from tests.support import Stack, running_stack

DAY = 86400.0
CHANNEL_NAMES = ["pages", "profile", "proactive", "experiences", "normal"]

ALICE_ROWS = [
    ("puppy", common_pb2.L2_RAW, "I adopted a golden retriever puppy named Biscuit in May.", ""),
    ("flag", common_pb2.L2_RAW, "Keep HYATLAS_SYNC_EXTRACT off on the staging box.", ""),
    ("pasta", common_pb2.L2_RAW, "We had pasta with pesto for dinner on Friday.", ""),
    ("tea_fact", common_pb2.L3_FACT, "User prefers green tea over coffee.", "user_preferences"),
    # The fact's profile mirror (the store makes none while one with its value is live).
    (
        "tea_profile",
        common_pb2.L1_PROFILE,
        "user prefers green tea  over coffee.",
        "user_preferences",
    ),
    (
        "exp",
        common_pb2.L3_FACT,
        "Deploying the garden app needs the staging box first.",
        "task_experience",
    ),
    ("page", common_pb2.L8_ENTITY, "Biscuit: the golden retriever puppy adopted in May.", ""),
]


def new_memory(
    user_id: str, layer: int, content: str, label: str = "", **extra: object
) -> store_pb2.Op:
    return store_pb2.Op(
        insert=store_pb2.NewMemory(
            owner=common_pb2.Owner(user_id=user_id, agent_id="hermes", session_id="s0"),
            layer=layer,  # type: ignore[arg-type]
            content=content,
            label=label,
            **extra,  # type: ignore[arg-type]
        )
    )


def apply(stack: Stack, user_id: str, ops: list[store_pb2.Op]) -> list[common_pb2.Memory]:
    with grpc.insecure_channel(stack.address("store")) as channel:
        reply = store_pb2_grpc.StoreStub(channel).Apply(
            store_pb2.ApplyRequest(scope=common_pb2.Scope(user_id=user_id), ops=ops, actor="api"),
            timeout=60,
        )
    return list(reply.memories)


@dataclass
class Seeded:
    """A running store + search stack and the ids of the rows seeded into it."""

    stack: Stack
    ids: dict[str, str]

    @property
    def address(self) -> str:
        return self.stack.address("search")


@pytest.fixture(scope="module")
def seeded(
    store_backend: str,
    tmp_path_factory: pytest.TempPathFactory,
    embedder_address: str,
) -> Iterator[Seeded]:
    """A store and a search process over a small data set of two users."""
    data_dir: Path = tmp_path_factory.mktemp("search")
    with running_stack(
        data_dir, ["store", "search"], HYATLAS_EMBEDDER_ADDR=embedder_address
    ) as stack:
        now = time.time()
        ops = [new_memory("alice", layer, text, label) for _, layer, text, label in ALICE_ROWS]
        ops += [
            new_memory(
                "alice",
                common_pb2.L7_INTENTION,
                "Book the vet visit for the puppy.",
                due_at=now + 3 * DAY,
            ),
            new_memory(
                "alice",
                common_pb2.L7_INTENTION,
                "Book the puppy vaccination visit.",
                due_at=now - 3 * DAY,
            ),
        ]
        names = [name for name, *_ in ALICE_ROWS] + ["due", "overdue"]
        inserted = apply(stack, "alice", ops)
        apply(stack, "bob", [new_memory("bob", common_pb2.L2_RAW, "My golden retriever is Max.")])
        yield Seeded(stack, {name: m.id for name, m in zip(names, inserted, strict=True)})


def search(
    address: str, query: str, user_id: str = "alice", **fields: object
) -> search_pb2.SearchMemoriesResponse:
    with grpc.insecure_channel(address) as channel:
        return search_pb2_grpc.SearchStub(channel).SearchMemories(
            search_pb2.SearchMemoriesRequest(
                scope=common_pb2.Scope(user_id=user_id),
                query=query,
                **fields,  # type: ignore[arg-type]
            ),
            timeout=30,
        )


def items(reply: search_pb2.SearchMemoriesResponse) -> list[common_pb2.ScoredMemory]:
    return [item for channel in reply.channels for item in channel.items]


def channel(reply: search_pb2.SearchMemoriesResponse, name: str) -> list[str]:
    [found] = [c for c in reply.channels if c.name == name]
    return [item.memory.id for item in found.items]


def test_paraphrase_is_found_by_vector(seeded: Seeded) -> None:
    query = "which dog did she get as a pet"
    reply = search(seeded.address, query, reader="vector", min_score=0.3, limit=3)
    assert channel(reply, "normal")[0] == seeded.ids["puppy"]
    assert items(search(seeded.address, query, reader="keyword")) == []


def test_exact_identifier_is_found_by_the_keyword_reader(seeded: Seeded) -> None:
    reply = search(seeded.address, "HYATLAS_SYNC_EXTRACT", reader="keyword")
    assert [i.memory.id for i in items(reply)] == [seeded.ids["flag"]]
    assert items(reply)[0].score == pytest.approx(1.0)


def test_hybrid_keeps_keyword_hits_the_vector_floor_drops_and_reports_their_cosine(
    seeded: Seeded,
) -> None:
    reply = search(seeded.address, "HYATLAS_SYNC_EXTRACT", min_score=0.99)
    [hit] = items(reply)
    assert hit.memory.id == seeded.ids["flag"]
    assert 0.0 < hit.score < 0.99


def test_another_users_rows_never_appear(seeded: Seeded) -> None:
    alice = search(seeded.address, "golden retriever", min_score=0.0, limit=50)
    assert all(i.memory.owner.user_id == "alice" for i in items(alice))
    bob = search(seeded.address, "golden retriever", user_id="bob", min_score=0.0, limit=50)
    assert [i.memory.content for i in items(bob)] == ["My golden retriever is Max."]


def test_min_score_zero_returns_weak_hits_and_near_one_drops_them(seeded: Seeded) -> None:
    query = "quantum chromodynamics lecture notes"
    weak = search(seeded.address, query, reader="vector", min_score=0.0, limit=3)
    assert len(items(weak)) == 3
    assert all(i.score < 0.5 for i in items(weak))
    assert items(search(seeded.address, query, reader="vector", min_score=0.99)) == []
    assert items(search(seeded.address, query, reader="vector")) == []


def test_l1_mirror_is_kept_over_its_l3_fact(seeded: Seeded) -> None:
    reply = search(seeded.address, "green tea or coffee", min_score=0.3, limit=10)
    found = [i.memory.id for i in items(reply)]
    assert seeded.ids["tea_profile"] in found
    assert seeded.ids["tea_fact"] not in found
    assert channel(reply, "profile")[0] == seeded.ids["tea_profile"]


def test_layers_go_to_their_channels_in_display_order(seeded: Seeded) -> None:
    query = "golden retriever puppy Biscuit staging box"
    reply = search(seeded.address, query, min_score=0.0, limit=20)
    assert [c.name for c in reply.channels] == CHANNEL_NAMES
    assert list(reply.order) == CHANNEL_NAMES
    assert not reply.HasField("now")
    assert channel(reply, "pages") == [seeded.ids["page"]]
    assert channel(reply, "experiences") == [seeded.ids["exp"]]
    assert seeded.ids["puppy"] in channel(reply, "normal")


def test_intention_a_day_past_due_is_not_returned(seeded: Seeded) -> None:
    reply = search(seeded.address, "book a visit for the puppy", min_score=0.0, limit=20)
    assert channel(reply, "proactive") == [seeded.ids["due"]]


def test_a_row_no_longer_true_is_not_returned(seeded: Seeded) -> None:
    now, l5 = time.time(), common_pb2.L5_KNOWLEDGE
    _, current, ending = apply(
        seeded.stack,
        "carol",
        [
            new_memory("carol", l5, "Foxtrot uses Postgres 15", valid_to=now - DAY),
            new_memory("carol", l5, "Foxtrot uses Postgres 16"),
            new_memory("carol", l5, "Foxtrot uses Redis 7", valid_to=now + DAY),
        ],
    )
    reply = search(seeded.address, "what Foxtrot uses", "carol", min_score=0.0, limit=20)
    assert sorted(i.memory.id for i in items(reply)) == sorted([current.id, ending.id])


def test_asking_for_a_layer_restricts_the_results(seeded: Seeded) -> None:
    reply = search(seeded.address, "golden retriever", layers=[common_pb2.L8_ENTITY], min_score=0.0)
    assert [i.memory.id for i in items(reply)] == [seeded.ids["page"]]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"query": ""}, "query required"),
        ({"query": "tea", "reader": "fuzzy"}, "unknown reader"),
        ({"query": "tea", "scope": common_pb2.Scope()}, "user_id"),
        ({"query": "tea", "reference_time": 1e17}, "reference_time"),
        ({"query": "tea", "reference_time": float("nan")}, "reference_time"),
        ({"query": "tea", "reference_utc_offset_minutes": -1440}, "reference_utc_offset_minutes"),
        (
            {"query": "tea", "reference_time": 253402300799.0, "reference_utc_offset_minutes": 60},
            "in the year 10000",
        ),
    ],
)
def test_bad_requests_are_invalid_arguments(
    seeded: Seeded, fields: dict[str, object], message: str
) -> None:
    request = search_pb2.SearchMemoriesRequest(scope=common_pb2.Scope(user_id="alice"))
    for name, value in fields.items():
        if name == "scope":
            request.scope.CopyFrom(value)
        else:
            setattr(request, name, value)
    with (
        grpc.insecure_channel(seeded.address) as conn,
        pytest.raises(grpc.RpcError) as caught,
    ):
        search_pb2_grpc.SearchStub(conn).SearchMemories(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (caught.value.details() or "")


def pro_search(
    seeded: Seeded, tmp_path: Path, embedder_address: str, query: str, **fields: object
) -> search_pb2.SearchMemoriesResponse:
    """One search through a search service of pro mode (which shows Now pages) on the seeded
    store, no score floor."""
    with running_stack(
        tmp_path,
        ["search"],
        HYATLAS_MODE="pro",
        HYATLAS_STORE_ADDR=seeded.stack.address("store"),
        HYATLAS_EMBEDDER_ADDR=embedder_address,
    ) as pro:
        return search(pro.address("search"), query, min_score=0.0, **fields)


def test_now_page_leads_the_order_in_llm_modes_and_stays_out_of_the_channels(
    seeded: Seeded, tmp_path: Path, embedder_address: str
) -> None:
    apply(
        seeded.stack,
        "alice",
        [new_memory("alice", common_pb2.L4_SUMMARY, "Now: training Biscuit.", "now_page")],
    )
    reply = pro_search(seeded, tmp_path, embedder_address, "training Biscuit", limit=20)
    assert list(reply.order) == ["now", *CHANNEL_NAMES]
    assert reply.now.memory.content == "Now: training Biscuit."
    assert "Now: training Biscuit." not in [i.memory.content for i in items(reply)]
    assert not search(seeded.address, "training Biscuit").HasField("now")


def test_the_now_page_is_found_however_many_episodes_came_after_it(
    seeded: Seeded, tmp_path: Path, embedder_address: str
) -> None:
    page = new_memory("carol", common_pb2.L4_SUMMARY, "Now: planning the move.", "now_page")
    apply(seeded.stack, "carol", [page])
    episodes = [
        new_memory("carol", common_pb2.L4_SUMMARY, f"Episode {n}: a talk about boxes.", "episode")
        for n in range(30)
    ]
    apply(seeded.stack, "carol", episodes)
    reply = pro_search(seeded, tmp_path, embedder_address, "moving boxes", user_id="carol")
    assert reply.now.memory.content == "Now: planning the move."
