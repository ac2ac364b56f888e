"""The store's part of ultra mode: graph edges, derived rows going stale, pass undo, state."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from tests.test_store import apply, insert, listed, raises_code, run_sql, scope, serving_store

L2, L3 = common_pb2.L2_RAW, common_pb2.L3_FACT
L4, L5, L6 = common_pb2.L4_SUMMARY, common_pb2.L5_KNOWLEDGE, common_pb2.L6_SCHEMA


@pytest.fixture
async def store(tmp_path: Path, embedder_address: str) -> AsyncIterator[store_pb2_grpc.StoreStub]:
    async with serving_store(tmp_path, embedder_address) as stub:
        yield stub


def edge(memory_id: str, sources: list[str], facts: list[str], **fields: Any) -> store_pb2.Op:
    return store_pb2.Op(
        put_edge=store_pb2.PutEdgeOp(
            owner=common_pb2.Owner(user_id="alice"),
            subject=fields.pop("subject", "Foxtrot"),
            relation="uses",
            object="Postgres 16",
            source_ids=sources,
            fact_ids=facts,
            memory_id=memory_id,
            **fields,
        )
    )


async def edges(stub: store_pb2_grpc.StoreStub, **kw: Any) -> list[store_pb2.Edge]:
    reply = await stub.ListEdges(store_pb2.ListEdgesRequest(scope=scope(), **kw))
    return list(reply.edges)


async def two_turns_two_facts(stub: store_pb2_grpc.StoreStub) -> tuple[list[str], list[str]]:
    raws = await apply(stub, insert("turn one", layer=L2), insert("turn two", layer=L2))
    raw_ids = [r.id for r in raws]
    facts = await apply(
        stub,
        insert("Foxtrot runs on Postgres", source_ids=[raw_ids[0]]),
        insert("Foxtrot moved to Postgres 16", source_ids=[raw_ids[1]]),
    )
    return raw_ids, [f.id for f in facts]


async def lose_evidence(stub: store_pb2_grpc.StoreStub, how: str, fact_id: str) -> None:
    """Forgets or deletes one row."""
    if how == "forget":
        await stub.Forget(store_pb2.ForgetRequest(scope=scope(), id=fact_id))
    else:
        await apply(stub, store_pb2.Op(delete=store_pb2.DeleteOp(id=fact_id)))


async def test_an_edge_needs_two_distinct_turns_and_nothing_of_the_apply_lands_otherwise(
    store: store_pb2_grpc.StoreStub,
) -> None:
    raw_ids, fact_ids = await two_turns_two_facts(store)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await apply(
            store,
            insert("Foxtrot uses Postgres 16", layer=L5, source_ids=fact_ids, ref="k"),
            edge("$k", [raw_ids[0], raw_ids[0]], fact_ids),
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await edges(store) == []
    listed = await store.ListMemories(store_pb2.ListMemoriesRequest(scope=scope(), layers=[L5]))
    assert list(listed.memories) == []


async def test_retiring_evidence_makes_the_edge_and_schema_stale_and_restoring_brings_them_back(
    store: store_pb2_grpc.StoreStub,
) -> None:
    raw_ids, fact_ids = await two_turns_two_facts(store)
    rows = await apply(
        store,
        insert("Foxtrot uses Postgres 16", layer=L5, source_ids=fact_ids, ref="k"),
        edge("$k", raw_ids, fact_ids),
        insert("Projects move to newer databases", layer=L6, source_ids=fact_ids),
    )
    knowledge, schema = rows[0], rows[2]
    assert [e.memory_id for e in await edges(store)] == [knowledge.id]

    await apply(
        store,
        store_pb2.Op(retire=store_pb2.RetireOp(id=fact_ids[0], superseded_how="forgotten")),
    )
    assert await edges(store) == []
    stale = await edges(store, include_stale=True)
    assert [e.stale for e in stale] == [True]
    for memory_id in (knowledge.id, schema.id):
        got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=memory_id))
        assert (got.memory.status, got.memory.superseded_how) == ("retired", "stale")

    await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=fact_ids[0])))
    assert [e.stale for e in await edges(store)] == [False]
    for memory_id in (knowledge.id, schema.id):
        got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=memory_id))
        assert got.memory.status == "active"


async def knowledge_over_two_facts(
    stub: store_pb2_grpc.StoreStub, **edge_fields: Any
) -> tuple[str, list[str]]:
    """An L5 row and its edge resting on two facts: the row's id and the facts'."""
    raw_ids, fact_ids = await two_turns_two_facts(stub)
    (knowledge, _) = await apply(
        stub,
        insert("Foxtrot uses Postgres 16", layer=L5, source_ids=fact_ids, ref="k"),
        edge("$k", raw_ids, fact_ids, **edge_fields),
    )
    return knowledge.id, fact_ids


async def status_of(stub: store_pb2_grpc.StoreStub, memory_id: str) -> tuple[str, str]:
    got = await stub.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=memory_id))
    return got.memory.status, got.memory.superseded_how


async def test_knowledge_a_schema_and_edges_written_after_their_evidence_was_forgotten_are_stale(
    store: store_pb2_grpc.StoreStub,
) -> None:
    raw_ids, fact_ids = await two_turns_two_facts(store)
    await lose_evidence(store, "forget", fact_ids[0])
    # What a pass that read the facts before the forget writes after it.
    rows = await apply(
        store,
        insert("Foxtrot uses Postgres 16", layer=L5, source_ids=fact_ids, ref="k"),
        edge("$k", raw_ids, fact_ids),
        insert("Projects move to newer databases", layer=L6, source_ids=fact_ids),
        edge("", raw_ids, fact_ids, subject="Foxtrot 2"),
    )
    knowledge, schema = rows[0], rows[2]
    for memory_id in (knowledge.id, schema.id):
        assert await status_of(store, memory_id) == ("retired", "stale")
    assert await edges(store) == []
    assert [e.stale for e in await edges(store, include_stale=True)] == [True, True]

    await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=fact_ids[0])))
    for memory_id in (knowledge.id, schema.id):
        assert await status_of(store, memory_id) == ("active", "")
    assert sorted(e.memory_id for e in await edges(store)) == ["", knowledge.id]


@pytest.mark.parametrize(("how", "gone"), [("forget", "forgotten"), ("delete", "erased")])
async def test_a_stale_row_is_not_restored_while_its_evidence_is_gone(
    store: store_pb2_grpc.StoreStub, how: str, gone: str
) -> None:
    knowledge, fact_ids = await knowledge_over_two_facts(store)
    await lose_evidence(store, how, fact_ids[0])

    with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as info:
        await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=knowledge)))
    assert f"rests on {fact_ids[0]!r}, which is {gone}" in info.value.details()
    assert await status_of(store, knowledge) == ("retired", "stale")
    assert await edges(store) == []


async def test_restoring_the_evidence_of_a_row_restored_over_it_unmarks_its_edge(
    tmp_path: Path, embedder_address: str, store_backend: str
) -> None:
    async with serving_store(tmp_path, embedder_address) as stub:
        knowledge, fact_ids = await knowledge_over_two_facts(stub)
        await lose_evidence(stub, "forget", fact_ids[0])
    # As a store before the restore check left it: the row restored, its evidence forgotten.
    await run_sql(
        tmp_path,
        store_backend,
        "UPDATE memories SET status = 'active', invalid_at = NULL, superseded_how = '' "
        f"WHERE id = '{knowledge}'",
    )
    async with serving_store(tmp_path, embedder_address) as stub:
        assert await edges(stub) == []
        await apply(stub, store_pb2.Op(restore=store_pb2.RestoreOp(id=fact_ids[0])))
        assert [e.memory_id for e in await edges(stub)] == [knowledge]


@pytest.mark.parametrize("how", ["forget", "delete"])
async def test_forgetting_or_deleting_an_l5_row_hides_its_own_edge(
    store: store_pb2_grpc.StoreStub, how: str
) -> None:
    knowledge, _ = await knowledge_over_two_facts(store)
    await lose_evidence(store, how, knowledge)

    assert await edges(store) == []
    assert [e.stale for e in await edges(store, include_stale=True)] == [True]
    if how == "forget":
        await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=knowledge)))
        assert [e.memory_id for e in await edges(store)] == [knowledge]


@pytest.mark.parametrize("how", ["forget", "delete", "delete every fact"])
async def test_an_edge_with_no_l5_row_goes_down_with_its_fact_and_comes_back_with_it(
    store: store_pb2_grpc.StoreStub, how: str
) -> None:
    raw_ids, fact_ids = await two_turns_two_facts(store)
    await apply(store, edge("", raw_ids, fact_ids))
    (made,) = await edges(store)
    if how == "delete every fact":
        await store.DeleteMemories(store_pb2.DeleteMemoriesRequest(scope=scope(), layers=[L3]))
    else:
        await lose_evidence(store, how, fact_ids[0])

    assert await edges(store) == []
    assert [(e.id, e.stale) for e in await edges(store, include_stale=True)] == [(made.id, True)]
    if how == "forget":
        await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=fact_ids[0])))
        assert [e.id for e in await edges(store)] == [made.id]


async def test_an_edge_with_no_l5_row_put_on_a_dropped_fact_is_live_once_the_fact_is_back(
    store: store_pb2_grpc.StoreStub,
) -> None:
    raw_ids, fact_ids = await two_turns_two_facts(store)
    await apply(
        store, store_pb2.Op(retire=store_pb2.RetireOp(id=fact_ids[0], superseded_how="dropped"))
    )
    await apply(store, edge("", raw_ids, fact_ids))
    assert await edges(store) == []

    await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=fact_ids[0])))
    assert len(await edges(store)) == 1


async def test_a_relation_learnt_again_while_its_old_edge_is_stale_gets_a_live_edge(
    store: store_pb2_grpc.StoreStub,
) -> None:
    old, fact_ids = await knowledge_over_two_facts(store)
    await lose_evidence(store, "forget", fact_ids[0])
    raw_ids, new_fact_ids = await two_turns_two_facts(store)
    (again, _) = await apply(
        store,
        insert("Foxtrot uses Postgres 16", layer=L5, source_ids=new_fact_ids, ref="k"),
        edge("$k", raw_ids, new_fact_ids),
    )

    (live,) = await edges(store)
    assert (live.memory_id, list(live.fact_ids)) == (again.id, new_fact_ids)
    stale = [e for e in await edges(store, include_stale=True) if e.stale]
    assert [(e.memory_id, list(e.fact_ids)) for e in stale] == [(old, fact_ids)]


async def test_a_merge_of_evidence_leaves_the_edge_live(store: store_pb2_grpc.StoreStub) -> None:
    raw_ids, fact_ids = await two_turns_two_facts(store)
    await apply(
        store,
        insert("Foxtrot uses Postgres 16", layer=L5, source_ids=fact_ids, ref="k"),
        edge("$k", raw_ids, fact_ids),
    )
    await apply(
        store,
        insert("Foxtrot is on Postgres 16", ref="m"),
        store_pb2.Op(
            retire=store_pb2.RetireOp(id=fact_ids[0], superseded_how="merged", superseded_by="$m")
        ),
    )
    assert len(await edges(store)) == 1


async def test_graph_as_of_shows_an_ended_edge_before_its_end_only(
    store: store_pb2_grpc.StoreStub,
) -> None:
    raw_ids, fact_ids = await two_turns_two_facts(store)
    await apply(store, edge("", raw_ids, fact_ids))
    (made,) = await edges(store)
    await apply(store, store_pb2.Op(end_edge=store_pb2.EndEdgeOp(id=made.id)))
    assert await edges(store) == []
    (ended,) = await edges(store, include_stale=True)
    assert ended.invalidated_at >= made.recorded_at
    before = await edges(store, as_of=made.recorded_at)
    after = await edges(store, as_of=ended.invalidated_at + 1)
    assert [e.id for e in before] == [made.id]
    assert after == []


async def test_an_edge_learnt_to_end_later_holds_till_then_now_and_as_of(
    store: store_pb2_grpc.StoreStub,
) -> None:
    knowledge, _ = await knowledge_over_two_facts(store)
    (made,) = await edges(store)
    later = time.time() + 30 * 86400.0
    await apply(store, end(made.id, valid_to=later))  # the lease ends next month
    # It left the graph at once, while its L5 row went on answering searches till then.
    assert [e.id for e in await edges(store)] == [made.id]
    (ended,) = await edges(store, include_stale=True)
    assert [e.id for e in await edges(store, as_of=ended.invalidated_at + 1)] == [made.id]
    assert await edges(store, as_of=later + 1) == []
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=knowledge))
    assert got.memory.valid_to == later


@pytest.mark.parametrize("how", ["forget", "delete"])
async def test_graph_as_of_leaves_out_an_edge_whose_evidence_is_forgotten_or_erased(
    store: store_pb2_grpc.StoreStub, how: str
) -> None:
    raw_ids, fact_ids = await two_turns_two_facts(store)
    await apply(
        store,
        insert("Foxtrot uses Postgres 16", layer=L5, source_ids=fact_ids, ref="k"),
        edge("$k", raw_ids, fact_ids),
    )
    (made,) = await edges(store)
    await lose_evidence(store, how, fact_ids[0])

    assert await edges(store, as_of=made.recorded_at) == []
    (hidden,) = await edges(store, as_of=made.recorded_at, include_stale=True)
    assert (hidden.id, hidden.stale) == (made.id, True)


def end(edge_id: str, **fields: Any) -> store_pb2.Op:
    return store_pb2.Op(end_edge=store_pb2.EndEdgeOp(id=edge_id, **fields))


async def test_an_ended_edge_ends_its_row_and_undoing_the_pass_puts_both_back(
    store: store_pb2_grpc.StoreStub,
) -> None:
    knowledge, _ = await knowledge_over_two_facts(store)
    (made,) = await edges(store)
    await apply(store, end(made.id, valid_to=1_750_000_000.0, pass_id="p-end"))
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=knowledge))
    assert (got.memory.status, got.memory.valid_to) == ("active", 1_750_000_000.0)

    await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-end", actor="api"))
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=knowledge))
    assert not got.memory.HasField("valid_to")
    assert [e.id for e in await edges(store)] == [made.id]


async def test_an_edge_cannot_end_before_it_began(store: store_pb2_grpc.StoreStub) -> None:
    knowledge, _ = await knowledge_over_two_facts(store, valid_from=1_768_435_200.0)
    (made,) = await edges(store)
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as info:
        await apply(store, end(made.id, valid_to=1_748_736_000.0))
    assert "cannot end (2025-06-01T00:00:00Z) before it began (2026-01-15" in info.value.details()
    assert [e.id for e in await edges(store)] == [made.id]
    # Nor is one written ended before it began.
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as info:
        await knowledge_over_two_facts(
            store, subject="Hotel", valid_from=1_768_435_200.0, valid_to=1_748_736_000.0)
    assert "an edge cannot end (2025-06-01T00:00:00Z) before it began" in info.value.details()
    assert [e.id for e in await edges(store)] == [made.id]
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=knowledge))
    assert not got.memory.HasField("valid_to")


async def test_undo_reverts_every_change_of_a_pass_and_nothing_else(
    store: store_pb2_grpc.StoreStub,
) -> None:
    raw_ids, fact_ids = await two_turns_two_facts(store)
    (other,) = await apply(store, insert("Alice likes tea"))
    rows = await apply(
        store,
        insert("Foxtrot runs Postgres 16", source_ids=raw_ids, ref="m", pass_id="p1"),
        *[
            store_pb2.Op(
                retire=store_pb2.RetireOp(
                    id=f, superseded_how="merged", superseded_by="$m", pass_id="p1"
                )
            )
            for f in fact_ids
        ],
        insert("Foxtrot uses Postgres 16", layer=L5, source_ids=fact_ids, ref="k", pass_id="p1"),
        edge("$k", raw_ids, fact_ids, pass_id="p1"),
        store_pb2.Op(
            retire=store_pb2.RetireOp(
                id=other.id, superseded_how="dropped", drop_reason="small talk", pass_id="p1"
            )
        ),
    )
    merged = rows[0]
    assert len(await edges(store)) == 1

    reply = await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p1", actor="api"))
    assert set(reply.restored_ids) == {*fact_ids, other.id}
    assert merged.id in reply.undone_ids
    assert await edges(store) == []
    live = await store.ListMemories(store_pb2.ListMemoriesRequest(scope=scope(), layers=[L3]))
    assert sorted(m.id for m in live.memories) == sorted([*fact_ids, other.id])

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await store.UndoPass(store_pb2.UndoPassRequest(pass_id="never"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_pass_is_undone_once_so_what_came_after_its_undo_stands(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (lunch,) = await apply(store, insert("Alice had a sandwich for lunch"))
    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(
        id=lunch.id, superseded_how="dropped", drop_reason="trivial", pass_id="p-once")))
    await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-once", actor="api"))
    await apply(  # the user edits the row the undo brought back
        store,
        insert("Alice had a cheese sandwich for lunch", ref="edit"),
        store_pb2.Op(retire=store_pb2.RetireOp(
            id=lunch.id, superseded_how="replaced", superseded_by="$edit")),
    )
    await knowledge_over_two_facts(store)
    (made,) = await edges(store)
    await apply(store, end(made.id, valid_to=1_750_000_000.0, pass_id="p-end-once"))
    await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-end-once", actor="api"))
    await apply(store, end(made.id, valid_to=1_760_000_000.0, pass_id="p-end-later"))

    # Undone again, each pass brought back what was changed since: two live versions of the
    # lunch, and the edge the later pass ended.
    for pass_id in ("p-once", "p-end-once"):
        with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as info:
            await store.UndoPass(store_pb2.UndoPassRequest(pass_id=pass_id, actor="api"))
        assert f"pass {pass_id!r} was undone already" in (info.value.details() or "")
    assert "Alice had a sandwich for lunch" not in await listed(store, layers=[L3])
    assert await edges(store) == []


async def merge_pass(stub: store_pb2_grpc.StoreStub, pass_id: str) -> tuple[list[str], str]:
    """Two facts merged by a pass into a new one: their ids and the merged row's."""
    _, fact_ids = await two_turns_two_facts(stub)
    retires = [
        store_pb2.Op(
            retire=store_pb2.RetireOp(
                id=f, superseded_how="merged", superseded_by="$m", pass_id=pass_id
            )
        )
        for f in fact_ids
    ]
    (merged, *_) = await apply(
        stub, insert("Foxtrot runs Postgres 16", ref="m", pass_id=pass_id), *retires
    )
    return fact_ids, merged.id


async def test_undo_keeps_retired_what_a_pass_merged_into_a_row_forgotten_since(
    store: store_pb2_grpc.StoreStub,
) -> None:
    fact_ids, merged = await merge_pass(store, "p-forgot")
    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=merged))

    reply = await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-forgot", actor="api"))
    assert (list(reply.restored_ids), sorted(reply.kept_ids)) == ([], sorted(fact_ids))
    assert await listed(store, layers=[L3]) == []


async def test_undo_keeps_retired_what_a_pass_merged_into_a_row_replaced_since(
    store: store_pb2_grpc.StoreStub,
) -> None:
    fact_ids, merged = await merge_pass(store, "p-replaced")
    await apply(
        store,
        insert("Foxtrot runs Postgres 17", ref="fix"),
        store_pb2.Op(
            retire=store_pb2.RetireOp(id=merged, superseded_how="replaced", superseded_by="$fix")
        ),
    )

    reply = await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-replaced", actor="api"))
    assert (list(reply.restored_ids), sorted(reply.kept_ids)) == ([], sorted(fact_ids))
    assert await listed(store, layers=[L3]) == ["Foxtrot runs Postgres 17"]


async def test_undo_keeps_forgotten_a_row_the_pass_replaced_and_the_user_forgot_since(
    store: store_pb2_grpc.StoreStub,
) -> None:
    _, (old, _) = await two_turns_two_facts(store)
    await apply(
        store,
        insert("Foxtrot's story: it moved to Postgres", ref="arc", pass_id="p-arc"),
        store_pb2.Op(retire=store_pb2.RetireOp(
            id=old, superseded_how="replaced", superseded_by="$arc", pass_id="p-arc")),
    )
    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=old))

    reply = await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-arc", actor="api"))
    assert (list(reply.restored_ids), list(reply.kept_ids)) == ([], [old])
    assert await listed(store, layers=[L3]) == ["Foxtrot moved to Postgres 16"]


async def test_undo_restores_a_dropped_value_said_again_after_it_was_forgotten(
    store: store_pb2_grpc.StoreStub,
) -> None:
    first, second = await apply(store, insert("turn one", layer=L2), insert("turn two", layer=L2))
    (old,) = await apply(store, insert("Alice likes green tea", source_ids=[first.id]))
    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=old.id))
    (again,) = await apply(store, insert("Alice likes green tea", source_ids=[second.id]))
    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(
        id=again.id, superseded_how="dropped", pass_id="p-again")))

    reply = await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-again", actor="api"))
    assert (list(reply.restored_ids), list(reply.kept_ids)) == ([again.id], [])
    assert await listed(store, layers=[L3]) == ["Alice likes green tea"]


async def test_undo_keeps_retired_a_dropped_value_said_again_since_and_says_why(
    store: store_pb2_grpc.StoreStub,
) -> None:
    first, second = await apply(store, insert("turn one", layer=L2), insert("turn two", layer=L2))
    (old,) = await apply(store, insert("Alice likes green tea", source_ids=[first.id]))
    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(
        id=old.id, superseded_how="dropped", pass_id="p-said")))
    (again,) = await apply(store, insert("Alice likes green tea!", source_ids=[second.id]))

    reply = await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-said", actor="api"))
    # Restore's rule: brought back, the value would be live twice.
    assert (list(reply.restored_ids), list(reply.kept_ids)) == ([], [old.id])
    assert again.id in reply.kept_why[old.id] and "said again" in reply.kept_why[old.id]
    assert await listed(store, layers=[L3]) == ["Alice likes green tea!"]
    assert await status_of(store, old.id) == ("retired", "dropped")


async def test_undo_brings_back_both_rows_a_pass_merged_that_hold_one_value(
    store: store_pb2_grpc.StoreStub,
) -> None:
    first, second = await apply(store, insert("turn one", layer=L2), insert("turn two", layer=L2))
    one, two = await apply(
        store,
        insert("Alice likes green tea", source_ids=[first.id]),
        insert("Alice likes green tea.", source_ids=[second.id]),
    )
    await apply(
        store,
        insert("Alice likes green tea", ref="m", pass_id="p-both"),
        *(store_pb2.Op(retire=store_pb2.RetireOp(
            id=r.id, superseded_how="merged", superseded_by="$m", pass_id="p-both"))
          for r in (one, two)),
    )

    reply = await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-both", actor="api"))
    # Neither is a live copy of the other: both were live before the pass.
    assert (sorted(reply.restored_ids), list(reply.kept_ids)) == (sorted([one.id, two.id]), [])


async def test_undo_keeps_retired_a_row_the_pass_retired_whose_evidence_is_forgotten_since(
    store: store_pb2_grpc.StoreStub,
) -> None:
    knowledge, fact_ids = await knowledge_over_two_facts(store)
    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(
        id=knowledge, superseded_how="dropped", pass_id="p-drop")))
    await lose_evidence(store, "forget", fact_ids[0])

    reply = await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-drop", actor="api"))
    assert (list(reply.restored_ids), list(reply.kept_ids)) == ([], [knowledge])
    assert await status_of(store, knowledge) == ("retired", "dropped")
    assert await edges(store) == []


async def test_a_stale_row_of_an_undone_pass_stays_down_when_its_evidence_comes_back(
    store: store_pb2_grpc.StoreStub,
) -> None:
    raw_ids, fact_ids = await two_turns_two_facts(store)
    (knowledge, _) = await apply(
        store,
        insert("Foxtrot uses Postgres 16", layer=L5, source_ids=fact_ids, ref="k", pass_id="p-k"),
        edge("$k", raw_ids, fact_ids, pass_id="p-k"),
    )
    await lose_evidence(store, "forget", fact_ids[0])

    reply = await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-k", actor="api"))
    assert list(reply.undone_ids) == [knowledge.id]
    await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=fact_ids[0])))
    assert await status_of(store, knowledge.id) == ("retired", "undone")
    assert await edges(store) == []


@pytest.mark.parametrize("label", ["now_page", "arc"])
async def test_undoing_a_pass_takes_down_a_now_page_or_arc_built_on_its_merge_until_restored(
    store: store_pb2_grpc.StoreStub, label: str
) -> None:
    fact_ids, merged = await merge_pass(store, "p-now")
    (other,) = await apply(store, insert("Alice likes tea"))
    (page,) = await apply(
        store,
        insert(
            "Alice runs Foxtrot on Postgres 16 and likes tea.",
            layer=L4, label=label, source_ids=[merged, other.id],
        ),
    )

    await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-now", actor="api"))
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=page.id))
    assert (got.memory.status, got.memory.superseded_how) == ("retired", "stale")
    assert got.memory.drop_reason == f"evidence {merged} was undone"
    assert await listed(store, layers=[L4]) == []
    with raises_code(grpc.StatusCode.FAILED_PRECONDITION):
        await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=page.id)))

    await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=merged)))
    assert await status_of(store, page.id) == ("active", "")


async def test_undoing_a_pass_whose_arc_went_stale_brings_the_arc_before_back(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (first, second) = await apply(store, insert("Alice teaches"), insert("Alice started a PhD"))
    (old_arc,) = await apply(store, insert(
        "Alice is a teacher.", layer=L4, label="arc", source_ids=[first.id], pass_id="p-arc1"))
    await apply(
        store,
        insert("Alice is a teacher working on a PhD.", layer=L4, label="arc",
               source_ids=[first.id, second.id], ref="arc", pass_id="p-arc2"),
        store_pb2.Op(retire=store_pb2.RetireOp(
            id=old_arc.id, superseded_how="replaced", superseded_by="$arc", pass_id="p-arc2")),
    )
    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=second.id))  # the new arc: stale

    reply = await store.UndoPass(store_pb2.UndoPassRequest(pass_id="p-arc2", actor="api"))
    # The old arc's own evidence stands: it comes back (it was kept, and the owner left with none).
    assert (list(reply.restored_ids), list(reply.kept_ids)) == ([old_arc.id], [])
    assert await listed(store, layers=[L4]) == ["Alice is a teacher."]


async def test_state_values_and_caller_chosen_ids(store: store_pb2_grpc.StoreStub) -> None:
    (row,) = await apply(
        store,
        insert("Alice likes tea", id="fact-1"),
    )
    assert row.id == "fact-1"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await apply(
            store,
            insert("again", id="fact-1"),
            store_pb2.Op(set_state=store_pb2.SetStateOp(key="c/x", value_json='{"a": 1}')),
        )
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    reply = await store.GetState(store_pb2.GetStateRequest(prefix="c/"))
    assert list(reply.values) == []
    await apply(store, store_pb2.Op(set_state=store_pb2.SetStateOp(key="c/x", value_json="[1]")))
    reply = await store.GetState(store_pb2.GetStateRequest(prefix="c/"))
    assert [(v.key, v.value_json) for v in reply.values] == [("c/x", "[1]")]
