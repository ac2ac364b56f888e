"""Entity page lines go stale with the facts and turns that fed them and come back with them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from shared.tombstones import tombstones
from tests.extractor_support import STACK, Api, by_content, new_user
from tests.llm_fake import FakeLlm, fake_llm_in_thread
from tests.support import running_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fake(store_backend: str) -> Iterator[FakeLlm]:
    with fake_llm_in_thread() as fake:
        fake.default = {}
        yield fake


@pytest.fixture(scope="module")
def api(
    store_backend: str,
    tmp_path_factory: pytest.TempPathFactory, embedder_address: str, fake: FakeLlm
) -> Iterator[Api]:
    """Pro mode with the scripted LLM, synchronous extraction, no catch-up."""
    with running_stack(
        tmp_path_factory.mktemp("pages"),
        STACK,
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_MODE="pro",
        HYATLAS_LLM_BASE=fake.url,
        HYATLAS_LLM_MODEL="scripted",
        HYATLAS_LLM_KEY="key",
        HYATLAS_EXTRACT_TIMEOUT="20s",
        HYATLAS_CATCHUP_EVERY="off",
    ) as stack:
        yield Api(stack.base_url, stack.address("store"))


async def change(api: Api, user: str, op: store_pb2.Op) -> None:
    async with open_channel(api.store_address) as channel:
        await store_pb2_grpc.StoreStub(channel).Apply(
            store_pb2.ApplyRequest(scope=common_pb2.Scope(user_id=user), ops=[op]), timeout=30
        )


async def test_retiring_a_fact_hides_the_page_lines_it_fed_and_restoring_it_shows_them(
    api: Api, fake: FakeLlm
) -> None:
    user = new_user()
    fake.on(
        "m-old",
        {
            "facts": [{"text": "Foxtrot runs on Postgres 15"}, {"text": "Bob likes tea"}],
            "entities": [{"name": "Foxtrot", "kind": "project", "state": "on Postgres 15"}],
        },
    )
    assert (await api.add("m-old Foxtrot is on Postgres 15; tea.", user))[
        "extraction_status"
    ] == "done"
    fake.on(
        "m-new",
        lambda r: {
            "facts": [{"text": "Foxtrot moved to Postgres 16"}],
            "entities": [
                {"name": "Foxtrot", "state": "on Postgres 16", "page": r.number_of("Foxtrot:")}
            ],
        },
    )
    assert (await api.add("m-new Foxtrot moved to Postgres 16.", user))[
        "extraction_status"
    ] == "done"
    facts = await api.rows(user, "l3_fact")
    old = by_content(facts, "Foxtrot runs on Postgres 15")
    new = by_content(facts, "Foxtrot moved to Postgres 16")
    tea = by_content(facts, "Bob likes tea")
    (page,) = await api.rows(user, "l8_entity")
    meta = json.loads(page.metadata_json)
    # Each line cites the facts of its turn that name the entity.
    assert meta["facts"] == [new.id]
    assert [h["facts"] for h in meta["history"]] == [[old.id]]
    full = page.content
    assert full.startswith("Foxtrot: on Postgres 16\nHistory:\n- ")
    assert full.endswith(": on Postgres 15")

    # Dropping a fact of the same turn that does not name the entity leaves the line (only a
    # forget or a delete of it does not).
    await change(
        api, user, store_pb2.Op(retire=store_pb2.RetireOp(id=tea.id, superseded_how="dropped"))
    )
    assert (await api.row(user, page.id)).content == full

    await change(
        api, user, store_pb2.Op(retire=store_pb2.RetireOp(id=new.id, superseded_how="dropped"))
    )
    stale = await api.row(user, page.id)
    assert stale.content.startswith("Foxtrot\nHistory:\n- ")
    assert "Postgres 16" not in stale.content and stale.status == "active"
    assert json.loads(stale.metadata_json)["stale"] is True
    hits = await api.search("Foxtrot Postgres 16", user)
    assert all("on Postgres 16" not in h.get("content", "") for h in hits)

    await change(
        api, user, store_pb2.Op(retire=store_pb2.RetireOp(id=old.id, superseded_how="dropped"))
    )
    empty = await api.row(user, page.id)
    # No line left: the page is retired, and comes back with a line.
    assert (empty.content, empty.status, empty.superseded_how) == ("Foxtrot", "retired", "stale")

    await change(api, user, store_pb2.Op(restore=store_pb2.RestoreOp(id=new.id)))
    one = await api.row(user, page.id)
    assert (one.content, one.status) == ("Foxtrot: on Postgres 16", "active")
    await change(api, user, store_pb2.Op(restore=store_pb2.RestoreOp(id=old.id)))
    back = await api.row(user, page.id)
    assert back.content == full
    assert "stale" not in json.loads(back.metadata_json)


JAY = {
    "facts": [{"text": "Jay's alarm code is 5566"}],
    "intentions": [{"text": "Jay will change the alarm code"}],
    "entities": [{"name": "Jay alarm", "state": "alarm code 5566"}],
}


async def jay_page(api: Api, fake: FakeLlm, user: str) -> tuple[str, common_pb2.Memory]:
    """The id of the turn "m-j1 Jay alarm code 5566" (a memory-tool entry) and the page it fed;
    its fact does not name the entity."""
    fake.on("m-j1", JAY)
    added = await api.add("m-j1 Jay alarm code 5566", user,
                          metadata={"write_origin": "memory_tool", "target": "memory"})
    assert added["extraction_status"] == "done"
    (page,) = await api.rows(user, "l8_entity")
    assert page.content == "Jay alarm: alarm code 5566"
    return added["memory_id"], page


async def page_in_search(api: Api, user: str) -> bool:
    hits = await api.search("alarm code", user)
    return any("5566" in h.get("content", "") for h in hits if h.get("layer") == "l8_entity")


async def restore(api: Api, user: str, memory_id: str) -> None:
    await api.ok("POST", "/api/v1/restore", json={"id": memory_id, "user_id": user})


async def test_forgetting_a_memory_tool_entry_retires_the_page_it_fed_until_restored(
    api: Api, fake: FakeLlm
) -> None:
    user = new_user()
    turn_id, page = await jay_page(api, fake, user)
    assert await page_in_search(api, user)
    body = await api.ok("POST", "/api/v1/forget", json={
        "text": "alarm code 5566", "user_id": user, "source": "memory_tool", "target": "memory"})
    (fact,) = await api.rows(user, "l3_fact")
    assert {m["memory_id"] for m in body["memories"]} >= {turn_id, fact.id}
    gone = await api.row(user, page.id)
    assert (gone.status, gone.superseded_how, gone.content) == ("retired", "stale", "Jay alarm")
    assert not await page_in_search(api, user)

    await restore(api, user, fact.id)
    assert (await api.row(user, page.id)).status == "retired"  # its turn is still forgotten
    await restore(api, user, turn_id)
    back = await api.row(user, page.id)
    assert (back.status, back.content) == ("active", "Jay alarm: alarm code 5566")
    assert await page_in_search(api, user)


async def test_a_forget_by_text_reaches_a_page_line_holding_it_and_the_fact_behind_it(
    api: Api, fake: FakeLlm
) -> None:
    user = new_user()
    turn_id, page = await jay_page(api, fake, user)
    body = await api.ok(
        "POST", "/api/v1/forget", json={"text": "alarm code 5566", "user_id": user})
    assert page.id in {m["memory_id"] for m in body["memories"]}
    assert (await api.row(user, page.id)).superseded_how == "forgotten"
    assert not await page_in_search(api, user)
    # The value is tombstoned on the line's turn, and lifted when the page is restored.
    assert "alarm code 5566" in tombstones((await api.row(user, turn_id)).metadata_json)
    await restore(api, user, page.id)
    assert (await api.row(user, page.id)).status == "active"
    assert tombstones((await api.row(user, turn_id)).metadata_json) == []

    # The fact does not name the entity, yet the line rests on it.
    await api.ok("POST", "/api/v1/forget",
                 json={"text": "Jay's alarm code is 5566", "user_id": user})
    (fact,) = await api.rows(user, "l3_fact")
    assert fact.superseded_how == "forgotten"
    assert (await api.row(user, page.id)).status == "retired"
    assert not await page_in_search(api, user)
    await restore(api, user, fact.id)
    assert (await api.row(user, page.id)).content == "Jay alarm: alarm code 5566"


async def test_deleting_the_fact_behind_a_page_line_leaves_the_page_without_it(
    api: Api, fake: FakeLlm
) -> None:
    user = new_user()
    await jay_page(api, fake, user)
    fake.on("m-j2", lambda r: {
        "facts": [{"text": "Jay's alarm now beeps twice"}],
        "entities": [{"name": "Jay alarm", "state": "beeps twice",
                      "page": r.number_of("Jay alarm:")}],
    })
    await api.add("m-j2 Jay alarm beeps twice now", user)
    (page,) = await api.rows(user, "l8_entity")
    assert page.content.startswith("Jay alarm: beeps twice\nHistory:\n- ")
    fact = by_content(await api.rows(user, "l3_fact"), "Jay's alarm code is 5566")
    await api.ok("POST", "/api/v1/delete_all", json={"id": fact.id, "user_id": user})
    after = await api.row(user, page.id)
    assert (after.status, after.content) == ("active", "Jay alarm: beeps twice")
    assert not await page_in_search(api, user)


async def test_a_page_retired_with_its_last_line_stays_retired_beside_a_newer_page_of_its_entity(
    api: Api, fake: FakeLlm
) -> None:
    user = new_user()
    _, page = await jay_page(api, fake, user)
    (fact,) = await api.rows(user, "l3_fact")
    await api.ok("POST", "/api/v1/forget", json={"id": fact.id, "user_id": user})
    assert (await api.row(user, page.id)).status == "retired"
    fake.on("m-j3", {"entities": [{"name": "Jay alarm", "state": "beeps twice"}]})
    await api.add("m-j3 Jay alarm beeps twice", user)
    newer = [p for p in await api.rows(user, "l8_entity") if p.id != page.id]
    assert [(p.content, p.status) for p in newer] == [("Jay alarm: beeps twice", "active")]
    await restore(api, user, fact.id)
    old = await api.row(user, page.id)
    assert (old.status, old.superseded_how) == ("retired", "stale")
