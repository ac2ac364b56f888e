"""Recall through the real stack: replaced versions on hits, turn context keys, usage feedback."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from shared.clients import EmbedderClient
from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from tests.support import Stack, running_stack


@pytest.fixture(scope="module")
def lite(
    store_backend: str,
    tmp_path_factory: pytest.TempPathFactory,
    embedder_address: str,
) -> Iterator[Stack]:
    data_dir: Path = tmp_path_factory.mktemp("recall")
    with running_stack(
        data_dir, ["store", "search", "gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address
    ) as stack:
        yield stack


def _user() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


async def call(stack: Stack, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(stack.base_url + path, json=body) as reply,
    ):
        return reply.status, await reply.json()


async def search(stack: Stack, user: str, query: str, **fields: Any) -> list[dict[str, Any]]:
    status, body = await call(
        stack, "/api/v1/search", {"query": query, "user_id": user, "limit": 10, **fields}
    )
    assert status == 200, body
    return [item for name in body["order"] for item in body["memories"].get(name, [])]


def apply(stack: Stack, user: str, ops: list[store_pb2.Op]) -> list[common_pb2.Memory]:
    with grpc.insecure_channel(stack.address("store")) as channel:
        reply = store_pb2_grpc.StoreStub(channel).Apply(
            store_pb2.ApplyRequest(scope=common_pb2.Scope(user_id=user), ops=ops, actor="api"),
            timeout=60,
        )
    return list(reply.memories)


def fact(user: str, text: str) -> store_pb2.Op:
    return store_pb2.Op(
        insert=store_pb2.NewMemory(
            owner=common_pb2.Owner(user_id=user), layer=common_pb2.L3_FACT, content=text
        )
    )


def retire(old: str, new: str) -> store_pb2.Op:
    return store_pb2.Op(
        retire=store_pb2.RetireOp(id=old, superseded_by=new, superseded_how="replaced")
    )


async def test_replaced_fact_shows_its_history_in_results(lite: Stack) -> None:
    user = _user()
    first, second, third = apply(
        lite,
        user,
        [
            fact(user, "User's office is in Leeds."),
            fact(user, "User's office is in York."),
            fact(user, "User's office is in Durham."),
        ],
    )
    apply(lite, user, [retire(first.id, second.id)])
    apply(lite, user, [retire(second.id, third.id)])

    hits = await search(lite, user, "where is the user's office")
    assert [hit["memory_id"] for hit in hits] == [third.id]
    replaced = hits[0]["replaced"]
    assert [old["memory_id"] for old in replaced] == [second.id, first.id]
    assert [old["content"] for old in replaced] == [
        "User's office is in York.",
        "User's office is in Leeds.",
    ]
    assert {old["superseded_how"] for old in replaced} == {"replaced"}


def learnt_from(user: str, text: str, turn_id: str) -> store_pb2.Op:
    op = fact(user, text)
    op.insert.source_ids.append(turn_id)
    return op


async def test_a_turn_whose_fact_was_replaced_comes_after_the_fact_now_true(lite: Stack) -> None:
    user = _user()
    turns = []
    for text in ("I live in Porto, in a flat by the river.", "We moved house last month."):
        status, body = await call(lite, "/api/v1/add", {"text": text, "user_id": user})
        assert status == 200, body
        turns.append(body["memory_id"])
    old, new = apply(
        lite,
        user,
        [
            learnt_from(user, "User lives in Porto.", turns[0]),
            learnt_from(user, "User lives in Lisbon.", turns[1]),
        ],
    )
    apply(lite, user, [retire(old.id, new.id)])
    query = "where do I live?"

    # The turn saying the old value shares the query's words; the fact now true does not.
    skipped = await search(lite, user, query, skip_stages=["replaced_turns"])
    plain = [hit["memory_id"] for hit in skipped]
    assert plain.index(turns[0]) < plain.index(new.id), plain

    found = [h["memory_id"] for h in await search(lite, user, query)]
    assert found.index(turns[0]) == found.index(new.id) + 1, found
    assert sorted(found) == sorted(plain)


async def test_a_turn_is_found_by_the_words_of_the_turn_before_it(lite: Stack) -> None:
    user = _user()
    turns = [
        "Sam: did you end up going to the farmers market on Saturday?",
        "Priya: yes! I came home with a cast iron skillet.",
        "Sam: the weather has been strange lately.",
    ]
    ids = []
    for text in turns:
        status, body = await call(
            lite, "/api/v1/add", {"text": text, "user_id": user, "session_id": "s1"}
        )
        assert status == 200, body
        ids.append(body["memory_id"])
    # No word of the answer turn is in the query: only its context key (with the turn before)
    # holds "farmers market".
    hits = await search(lite, user, "what did Priya get at the farmers market", min_score=0.99)
    found = [hit["memory_id"] for hit in hits]
    assert ids[1] in found
    # The value returned is the memory itself, never the derived key's text.
    answer = next(hit for hit in hits if hit["memory_id"] == ids[1])
    assert answer["content"] == turns[1]


async def test_context_keys_can_be_switched_off_per_request(lite: Stack) -> None:
    user = _user()
    for text in ("Ana: which museum was it?", "Ben: the one with the whale skeleton."):
        status, body = await call(
            lite, "/api/v1/add", {"text": text, "user_id": user, "session_id": "s1"}
        )
        assert status == 200, body
    question = "what did they see at the museum?"
    on = await search(lite, user, question, min_score=0.99)
    off = await search(lite, user, question, min_score=0.99, skip_stages=["context_keys"])
    assert {hit["content"] for hit in on} == {
        "Ana: which museum was it?",
        "Ben: the one with the whale skeleton.",
    }
    # Without context keys only the turn holding the query's words is found.
    assert [hit["content"] for hit in off] == ["Ana: which museum was it?"]


async def test_unknown_stage_in_a_request_is_a_400(lite: Stack) -> None:
    status, body = await call(
        lite, "/api/v1/search", {"query": "x", "user_id": _user(), "skip_stages": ["nope"]}
    )
    assert status == 400
    assert "unknown search stage nope" in body["error"]


async def test_feedback_counts_a_use_and_refuses_another_owners_memory(lite: Stack) -> None:
    user, other = _user(), _user()
    status, mine = await call(lite, "/api/v1/add", {"text": "I keep bees.", "user_id": user})
    assert status == 200
    status, theirs = await call(lite, "/api/v1/add", {"text": "I keep goats.", "user_id": other})
    assert status == 200

    status, body = await call(
        lite, "/api/v1/feedback", {"memory_ids": [mine["memory_id"]], "user_id": user}
    )
    assert status == 200, body
    assert body == {"success": True, "recorded": 1, "usage_learning": True}

    status, body = await call(
        lite,
        "/api/v1/feedback",
        {"memory_ids": [mine["memory_id"], theirs["memory_id"]], "user_id": user},
    )
    assert status == 404, body
    with grpc.insecure_channel(lite.address("store")) as channel:
        stub = store_pb2_grpc.StoreStub(channel)
        got = {
            owner: stub.GetMemory(
                store_pb2.GetMemoryRequest(scope=common_pb2.Scope(user_id=owner), id=memory_id),
                timeout=30,
            ).memory.hits
            for owner, memory_id in ((user, mine["memory_id"]), (other, theirs["memory_id"]))
        }
    # The refused call counted nothing, not even the owner's own memory.
    assert got == {user: 1, other: 0}


async def test_concurrent_feedback_loses_no_count(lite: Stack) -> None:
    user = _user()
    added = [
        (await call(lite, "/api/v1/add", {"text": f"I keep {animal}.", "user_id": user}))[1]
        for animal in ("bees", "goats")
    ]
    ids = [a["memory_id"] for a in added]
    # 2 x 10 calls at once, each counting both memories: read-then-write would lose some.
    replies = await asyncio.gather(*(
        call(lite, "/api/v1/feedback", {"memory_ids": ids, "user_id": user}) for _ in range(20)
    ))
    assert [status for status, _ in replies] == [200] * 20
    with grpc.insecure_channel(lite.address("store")) as channel:
        stub = store_pb2_grpc.StoreStub(channel)
        hits = [
            stub.GetMemory(
                store_pb2.GetMemoryRequest(scope=common_pb2.Scope(user_id=user), id=memory_id),
                timeout=30,
            ).memory.hits
            for memory_id in ids
        ]
    assert hits == [20, 20]


async def test_feedback_without_ids_is_a_400(lite: Stack) -> None:
    status, body = await call(lite, "/api/v1/feedback", {"user_id": _user()})
    assert status == 400
    assert "memory_ids required" in body["error"]


def turn(user: str, text: str) -> store_pb2.Op:
    return store_pb2.Op(
        insert=store_pb2.NewMemory(
            owner=common_pb2.Owner(user_id=user, session_id="s1"),
            layer=common_pb2.L2_RAW,
            content=text,
        )
    )


REPEATED = "I had coffee with Sam at the cafe."
OTHERS = [
    "I had coffee with Sam at the cafe and he said he is moving to Paris in March.",
    "Sam's cafe order is always a flat white.",
]


@pytest.mark.parametrize("reader", ["hybrid", "vector", "keyword", "rrf"])
async def test_copies_of_one_text_leave_room_for_the_other_texts(lite: Stack, reader: str) -> None:
    user = _user()
    apply(lite, user, [turn(user, REPEATED)] * 60 + [turn(user, text) for text in OTHERS])
    hits = await search(
        lite, user, "coffee with Sam at the cafe", reader=reader, min_score=0, limit=10
    )
    assert sorted(hit["content"] for hit in hits) == sorted([REPEATED, *OTHERS])


MOVED = "Priya moved to Lisbon with her partner in the first week of May."
# Notes that each hold that sentence beside another that has nothing to do with it, and notes
# about the move in other words.
SHARING = [
    f"{MOVED} Budget item {i}: the quarterly review of team {i} slipped to next Thursday "
    "because the outside auditors were late again."
    for i in range(30)
]
ABOUT_THE_MOVE = [
    "Priya's new flat in Lisbon is near the river; she arrived there in early May.",
    "Priya says the move from Leeds to Portugal went smoothly this spring.",
    "Priya and her partner now live in Lisbon.",
]


async def nearest_to_moved(
    stack: Stack, embedder_address: str, scope: common_pb2.Scope, k: int, distinct_text: bool
) -> list[tuple[str, float]]:
    """The store's vector search for MOVED: each hit's text and score."""
    async with open_channel(embedder_address) as channel:
        (vector,), model_id = await EmbedderClient(channel).embed([MOVED], is_query=True)
    async with open_channel(stack.address("store")) as channel:
        reply = await store_pb2_grpc.StoreStub(channel).VectorSearch(
            store_pb2.VectorSearchRequest(
                scope=scope, vector=vector.tolist(), model_id=model_id, k=k,
                distinct_text=distinct_text,
            )
        )
    return [(hit.memory.content, hit.score) for hit in reply.hits]


async def test_a_vector_search_leaves_out_memories_found_by_a_sentence_already_shown(
    lite: Stack, embedder_address: str
) -> None:
    user = _user()
    apply(lite, user, [turn(user, text) for text in [*SHARING, *ABOUT_THE_MOVE]])

    async def nearest(distinct_text: bool) -> list[str]:
        scope = common_pb2.Scope(user_id=user)
        found = await nearest_to_moved(lite, embedder_address, scope, 5, distinct_text)
        return [text for text, _ in found]

    every = await nearest(distinct_text=False)
    assert len(every) == 5 and set(every) <= set(SHARING)
    # The notes found by the sentence the first holds repeat it: the next distinct ones come.
    shown = await nearest(distinct_text=True)
    assert shown[0] in SHARING and sorted(shown[1:]) == sorted(ABOUT_THE_MOVE)


def agents_note(user: str, agent: str, text: str) -> store_pb2.Op:
    return store_pb2.Op(
        insert=store_pb2.NewMemory(
            owner=common_pb2.Owner(user_id=user, agent_id=agent, session_id="s1"),
            layer=common_pb2.L2_RAW,
            content=text,
        )
    )


async def test_a_note_found_by_a_sentence_whose_nearer_holders_are_out_of_reach_is_found(
    lite: Stack, embedder_address: str
) -> None:
    # Ten notes of another agent and one of this agent's hold the sentence asked for.
    user, theirs, mine = _user(), SHARING[:10], SHARING[10]
    apply(lite, user, [agents_note(user, "travel", text) for text in theirs])
    apply(lite, user, [agents_note(user, "home", text) for text in [mine, *ABOUT_THE_MOVE]])

    async def nearest(agent: str, distinct_text: bool, k: int) -> list[tuple[str, float]]:
        scope = common_pb2.Scope(user_id=user, agent_id=agent)
        return await nearest_to_moved(lite, embedder_address, scope, k, distinct_text)

    # The nearest notes holding it are the other agent's, whose rows this agent's search skips.
    assert (await nearest("", distinct_text=False, k=1))[0][0] in theirs
    shown = await nearest("home", distinct_text=True, k=4)
    assert sorted(text for text, _ in shown) == sorted([mine, *ABOUT_THE_MOVE])
    assert [score for _, score in shown] == sorted((score for _, score in shown), reverse=True)


async def test_notes_repeating_the_sentence_found_leave_room_for_other_answers(
    lite: Stack,
) -> None:
    user = _user()
    apply(lite, user, [turn(user, text) for text in [*SHARING, *ABOUT_THE_MOVE]])
    for reader in ("vector", "hybrid"):
        hits = await search(lite, user, "When did Priya move to Lisbon?", reader=reader)
        contents = [hit["content"] for hit in hits]
        assert set(ABOUT_THE_MOVE) <= set(contents), reader
        if reader == "vector":  # the hybrid finds the other notes by their words too
            assert sum(text in SHARING for text in contents) == 1
