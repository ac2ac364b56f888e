"""Lite mode runs the embedder, the store, search and the gateway, nothing else: every route a
lite user has works without the extractor and the consolidator, or says why it does not apply."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from shared.tombstones import tombstones
from tests.extractor_support import Api, by_content, new_user
from tests.support import Stack, running_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, embedder_address: str, store_backend: str
) -> Iterator[Stack]:
    """Store (on each backend), search and the gateway, in lite mode with admin on."""
    with running_stack(
        tmp_path_factory.mktemp("lite"),
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_MODE="lite",
        HYATLAS_ADMIN="on",
    ) as running:
        yield running


@pytest.fixture
def api(stack: Stack) -> Api:
    return Api(stack.base_url, stack.address("store"))


async def test_lite_is_ready_without_the_extractor_and_the_consolidator(api: Api) -> None:
    status, body = await api.call("GET", "/readyz")
    assert status == 200, body
    assert body["services"] == {"embedder": "serving", "store": "serving", "search": "serving"}
    assert (await api.status())["llm"] == "unused"


async def test_forget_by_text_retires_the_turn_and_tombstones_its_value(api: Api) -> None:
    user = new_user()
    kept = (await api.add("The spare key is under the blue flowerpot", user))["memory_id"]
    gone = (await api.add("My bank PIN is 4471", user))["memory_id"]
    body = await api.ok("POST", "/api/v1/forget", json={
        "text": "My bank PIN is 4471", "user_id": user, "reason": "a secret"})
    assert body["forgotten"] == 1 and body["evidence_ids"] == [gone]
    forgotten = await api.row(user, gone)
    assert (forgotten.status, forgotten.superseded_how, forgotten.drop_reason) == (
        "retired", "forgotten", "a secret")
    assert tombstones(forgotten.metadata_json) == ["my bank pin is 4471"]
    assert (await api.row(user, kept)).status == "active"
    # No floor: every live row of the owner may come back, the forgotten one never.
    hits = await api.search("bank PIN", user, min_score=0)
    assert {hit["memory_id"] for hit in hits} == {kept}


async def test_a_forgotten_turn_restored_over_grpc_loses_its_tombstone(api: Api) -> None:
    user = new_user()
    turn = (await api.add("My locker code is 2208", user))["memory_id"]
    await api.ok("POST", "/api/v1/forget", json={"text": "My locker code is 2208", "user_id": user})
    assert tombstones((await api.row(user, turn)).metadata_json) == ["my locker code is 2208"]

    async with open_channel(api.store_address) as channel:
        await store_pb2_grpc.StoreStub(channel).Apply(store_pb2.ApplyRequest(
            scope=common_pb2.Scope(user_id=user),
            ops=[store_pb2.Op(restore=store_pb2.RestoreOp(id=turn))],
            actor="another-tool",
        ))
    restored = await api.row(user, turn)
    assert restored.status == "active" and tombstones(restored.metadata_json) == []


@pytest.mark.parametrize("by", ["memory_id", "text"])
async def test_forgetting_an_old_address_hides_it_from_the_new_one(api: Api, by: str) -> None:
    user = new_user()
    old_text = "My home address is 12 Elm Street, Springfield."
    old = (await api.add(old_text, user))["memory_id"]
    new = (await api.ok("POST", "/api/v1/update", json={
        "id": old, "text": "My home address is 40 Oak Avenue, Shelbyville.", "user_id": user,
    }))["memory_id"]
    asked = {"memory_id": old} if by == "memory_id" else {"text": old_text}
    body = await api.ok("POST", "/api/v1/forget", json={**asked, "user_id": user})
    assert body["forgotten"] == 1 and body["evidence_ids"] == [old]
    forgotten = await api.row(user, old)
    assert (forgotten.superseded_how, forgotten.superseded_by) == ("forgotten", new)
    assert tombstones(forgotten.metadata_json) == ["my home address is 12 elm street springfield"]
    hits = await api.search("home address", user)
    assert {hit["memory_id"] for hit in hits} == {new}
    assert [hit.get("replaced", []) for hit in hits] == [[] for _ in hits]


async def test_forget_by_id_outside_the_owner_is_404_and_changes_nothing(api: Api) -> None:
    user = new_user()
    memory_id = (await api.add("Lunch with Dana on Friday", user))["memory_id"]
    status, body = await api.call(
        "POST", "/api/v1/forget", json={"id": memory_id, "user_id": new_user()})
    assert status == 404, body
    assert (await api.row(user, memory_id)).status == "active"


async def test_compact_raw_rewrites_long_turns_after_a_dry_run(api: Api) -> None:
    user = new_user()
    turn = "USER: where is the meeting\n\nTOOL: " + "x" * 80 + "\n\nASSISTANT: " + "y" * 5000
    memory_id = (await api.add(turn, user))["memory_id"]
    dry = await api.ok("POST", "/api/v1/admin/compact_raw", json={})
    assert dry["dry_run"] is True and memory_id in dry["sample"] and dry["rows_rewritten"] == 0
    assert (await api.row(user, memory_id)).content == turn
    done = await api.ok("POST", "/api/v1/admin/compact_raw", json={"dry_run": False})
    assert done["rows_rewritten"] == done["rows_changed"] >= 1
    compacted = (await api.row(user, memory_id)).content
    assert "TOOL" not in compacted and compacted.startswith("USER: where is the meeting")
    history = await api.ok("POST", "/api/v1/history", json={"id": memory_id, "user_id": user})
    changed = history["history"][-1]
    assert changed["reason"] == "admin compact_raw"
    assert (changed["before"]["content"], changed["after"]["content"]) == (turn, compacted)


async def test_dedupe_facts_runs_in_the_store(api: Api) -> None:
    body = await api.ok("POST", "/api/v1/admin/dedupe_facts", json={"threshold": 0.95})
    assert body["dry_run"] is True and body["threshold"] == 0.95


async def test_what_needs_an_llm_or_the_slow_path_says_so(api: Api) -> None:
    user = new_user()
    await api.add("Pick up the parcel on Monday", user)
    reprocess = await api.ok("POST", "/api/v1/reprocess", json={})
    assert reprocess["reprocessed"] == 0 and "lite" in reprocess["note"]
    # What pro and ultra refuse, lite refuses too (it answered 200).
    for body, error in (({"max": 1001}, "max is at most 1,000 a call; call again for the rest"),
                        ({"ids": ["a", " "]}, "ids[1] is blank")):
        status, refused = await api.call("POST", "/api/v1/reprocess", json=body)
        assert (status, refused["error"]) == (400, error)
    digest = await api.ok("GET", "/api/v1/digest")
    assert digest["digest_ok"] is False and "ultra" in digest["reason"]
    status, body = await api.call("POST", "/api/v1/undo_pass", json={"pass_id": "p-1"})
    assert status == 409 and "ultra" in body["error"], body
    rows = await api.rows(user, "l2_raw")
    assert by_content(rows, "Pick up the parcel on Monday").status == "active"
