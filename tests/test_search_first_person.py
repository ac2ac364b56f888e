"""Questions about the asker prefer what the asker said of themself (real model, real stack)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from services.search.ranking import asks_about_owner, speaks_of_someone_else
from tests.support import Stack, running_stack

# (memories, question, the memory that answers it)
CASES = [
    (["My brother Tiago lives in Berlin", "I moved to Lisbon in March"], "where do I live?", 1),
    (["My sister works as a nurse in Leeds", "I work as a software engineer"],
     "what do I do for work?", 1),
    (["My wife loves sushi", "I am allergic to shellfish"], "what am I allergic to?", 1),
    (["My dad drives a red Volvo", "I drive a blue bike to work"], "what do I drive?", 1),
    (["My friend Ana plays the violin", "I play the guitar on weekends"],
     "which instrument do I play?", 1),
    (["My son is 12 years old", "I turned 41 last week"], "how old am I?", 1),
    (["My boss prefers morning meetings", "I prefer to meet in the afternoon"],
     "when do I prefer meetings?", 1),
    (["My mother was born in Porto", "I was born in Coimbra"], "where was I born?", 1),
    (["My partner speaks German", "I speak Spanish and French"], "what languages do I speak?", 1),
    (["My neighbour has two cats", "I have a dog named Rex"], "what pet do I have?", 1),
    (["My colleague runs marathons", "I swim twice a week"], "what sport do I do?", 1),
    (["My cousin studies law in Paris", "I studied physics at university"],
     "what did I study?", 1),
    # Asked about someone else, their memory still wins.
    (["My brother Tiago lives in Berlin", "I moved to Lisbon in March"],
     "where does my brother live?", 0),
]


@pytest.fixture(scope="module")
def lite(
    store_backend: str,
    tmp_path_factory: pytest.TempPathFactory,
    embedder_address: str,
) -> Iterator[Stack]:
    data_dir: Path = tmp_path_factory.mktemp("first-person")
    with running_stack(
        data_dir, ["store", "search", "gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address
    ) as stack:
        yield stack


async def top_hit(stack: Stack, memories: list[str], question: str, **fields: object) -> str:
    user = f"user-{uuid.uuid4().hex[:8]}"
    async with aiohttp.ClientSession() as http:
        for text in memories:
            async with http.post(
                stack.base_url + "/api/v1/add", json={"text": text, "user_id": user}
            ) as reply:
                assert reply.status == 200, await reply.text()
        body = {"query": question, "user_id": user, "limit": 5, "min_score": 0, **fields}
        async with http.post(stack.base_url + "/api/v1/search", json=body) as reply:
            found = await reply.json()
    return [i for name in found["order"] for i in found["memories"].get(name, [])][0]["content"]


@pytest.mark.parametrize(("memories", "question", "answer"), CASES)
async def test_a_question_about_the_asker_finds_their_own_statement(
    lite: Stack, memories: list[str], question: str, answer: int
) -> None:
    assert await top_hit(lite, memories, question) == memories[answer]


async def test_without_the_stage_a_shared_keyword_puts_the_brother_first(lite: Stack) -> None:
    memories, question, _ = CASES[0]
    found = await top_hit(lite, memories, question, skip_stages=["first_person"])
    assert found == memories[0]


def test_who_a_question_and_a_memory_are_about() -> None:
    assert asks_about_owner("where do I live?") and asks_about_owner("What's my job?")
    assert not asks_about_owner("where does my brother live?")
    assert not asks_about_owner("What did Caroline research?")
    assert speaks_of_someone_else("My best friend Ana plays the violin")
    assert not speaks_of_someone_else("I visited my sister in Leeds")
    assert not speaks_of_someone_else("My favourite food is sushi")
