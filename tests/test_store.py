"""The store service over real gRPC: rows, scopes, audit, keyword and vector search, durability."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import numpy as np
import pytest
from usearch.index import Index, ScalarKind

from services.store import forget as forget_module
from services.store import fulltext, keywords, off_calendar, retrieval, text_index
from services.store import repo as repo_module
from services.store.index import VectorIndexes, read_index_file
from services.store.model import FEW_PASSING, MemoryRow
from services.store.pg.repo import PgRepo
from services.store.pg.vectors import PgVectors
from services.store.reembed import ReembedPlan
from services.store.repo import MEMORIES_OF_KEYS, VECTOR_MODELS
from services.store.schema import SCHEMA_VERSION
from services.store.server import running_server
from services.store.text_index import SOURCES, KeywordIndex
from services.store.transfer_repo import TransferRows
from services.store.validate import MAX_APPLY_OPS
from shared.aliases import Aliases
from shared.clients import EmbedderClient
from shared.grants import Grant
from shared.layers import EXTRACTION_TRIES
from shared.leases import LEASE_NAME_MAX, LEASE_TTL_MAX_S, lease_name
from shared.limits import (
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_KEY_CHARS,
    MAX_NAME_CHARS,
    MAX_TEXT_CHARS,
)
from shared.owner_state import NOW_ASKED, owner_key
from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import GRANT_METADATA, open_channel
from shared.store_client import PAGE, all_rows, owner_state_op, state_op
from shared.text import content_key, value_key
from shared.tombstones import held_tombstones, tombstones
from tests.store_state import store_config
from tests.support import ROOT, WAIT_CEILING_S, StoreBackend, assert_eventually, running_stack

FIXTURES = Path(__file__).parent / "fixtures"
L2, L3, L7 = common_pb2.L2_RAW, common_pb2.L3_FACT, common_pb2.L7_INTENTION


@contextlib.asynccontextmanager
async def serving_store(
    data_dir: Path, embedder_address: str, **options: Any
) -> AsyncIterator[store_pb2_grpc.StoreStub]:
    """An in-process store on a unix socket in data_dir, and a stub talking to it."""
    config = store_config(data_dir, embedder_address, **options)
    async with running_server(config) as address, open_channel(address) as channel:
        yield store_pb2_grpc.StoreStub(channel)


@pytest.fixture
async def store(tmp_path: Path, embedder_address: str) -> AsyncIterator[store_pb2_grpc.StoreStub]:
    async with serving_store(tmp_path, embedder_address) as stub:
        yield stub


@pytest.fixture
def usearch_indexes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every user's vector index a usearch one, saved as a file (a flat one, for a user of few
    vectors, is built from SQLite when it loads and never saved)."""
    monkeypatch.setattr("services.store.index.FLAT_UP_TO", 0)


@pytest.fixture
async def embedder(embedder_address: str) -> AsyncIterator[EmbedderClient]:
    async with open_channel(embedder_address) as channel:
        yield EmbedderClient(channel)


def scope(user: str = "alice", agent: str = "", all_users: bool = False) -> common_pb2.Scope:
    return common_pb2.Scope(user_id=user, agent_id=agent, all_users=all_users)


def insert(
    content: str, user: str = "alice", layer: int = L3, agent: str = "", **fields: Any
) -> store_pb2.Op:
    owner = common_pb2.Owner(user_id=user, agent_id=agent, session_id=fields.pop("session", ""))
    return store_pb2.Op(
        insert=store_pb2.NewMemory(owner=owner, layer=layer, content=content, **fields)
    )


async def apply(
    stub: store_pb2_grpc.StoreStub, *ops: store_pb2.Op, user: str = "alice", **kw: Any
) -> list[common_pb2.Memory]:
    reply = await stub.Apply(store_pb2.ApplyRequest(scope=scope(user), ops=ops, **kw))
    return list(reply.memories)


async def listed(stub: store_pb2_grpc.StoreStub, user: str = "alice", **kw: Any) -> list[str]:
    reply = await stub.ListMemories(store_pb2.ListMemoriesRequest(scope=scope(user), **kw))
    return [m.content for m in reply.memories]


async def vector_hits(
    stub: store_pb2_grpc.StoreStub,
    embedder: EmbedderClient,
    query: str,
    user: str = "alice",
    **kw: Any,
) -> list[common_pb2.ScoredMemory]:
    vectors, model_id = await embedder.embed([query], is_query=True)
    reply = await stub.VectorSearch(
        store_pb2.VectorSearchRequest(
            scope=kw.pop("scope", None) or scope(user),
            vector=vectors[0].tolist(),
            model_id=kw.pop("model_id", model_id),
            **kw,
        )
    )
    return list(reply.hits)


@contextlib.contextmanager
def raises_code(code: grpc.StatusCode) -> Iterator[pytest.ExceptionInfo[grpc.aio.AioRpcError]]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        yield info
    assert info.value.code() == code, info.value.details()


async def test_inserted_row_is_listed_got_and_found_by_keyword_and_vector_search(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    (row,) = await apply(
        store,
        insert(
            "Alice adopted a grey cat named Miso",
            session="s1",
            label="user_info",
            metadata_json='{"source": "chat"}',
            source_ids=["raw-1"],
            event_at=1700000000.0,
        ),
        actor="api",
    )
    assert row.id and row.status == "active" and row.model_id
    assert row.owner.session_id == "s1" and row.HasField("event_at")
    assert json.loads(row.metadata_json) == {"source": "chat"}

    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=row.id))
    assert got.memory == row
    assert await listed(store) == ["Alice adopted a grey cat named Miso"]

    keyword = await store.KeywordSearch(
        store_pb2.KeywordSearchRequest(scope=scope(), query="What's my cat's name, Miso?")
    )
    assert [h.hit.memory.id for h in keyword.hits] == [row.id]
    assert list(keyword.terms) == ["cat", "name", "miso"]

    hits = await vector_hits(store, embedder, "what pet does alice have")
    assert [h.memory.id for h in hits] == [row.id]
    assert 0.3 < hits[0].score <= 1.0001


def test_a_row_read_keeps_each_column_in_the_field_of_its_name() -> None:
    columns = [name.strip() for name in repo_module._COLUMNS.split(",")]
    values: list[Any] = [f"value of {name}" for name in columns]
    values[columns.index("source_ids")] = '["a", "b"]'
    row = repo_module._row([*values, "a column past them"])
    for name, value in zip(columns, values, strict=True):
        field = "metadata_json" if name == "metadata" else name
        assert getattr(row, field) == (("a", "b") if name == "source_ids" else value)
    built = MemoryRow(**{f.name: getattr(row, f.name) for f in dataclasses.fields(MemoryRow)})
    assert row == built and hash(row) == hash(built)
    assert repo_module._row([*values[:9], "[]", *values[10:]]).source_ids == ()


async def test_list_pages_filters_and_orders(store: store_pb2_grpc.StoreStub) -> None:
    for i in range(5):
        await apply(store, insert(f"raw turn {i}", layer=L2, session="s1",
                                  extraction_status="pending" if i % 2 else "done"))
    await apply(store, insert("a fact", session="s2"), insert("call mom", layer=L7))

    assert await listed(store, limit=2) == ["call mom", "a fact"]
    assert await listed(store, limit=2, offset=2) == ["raw turn 4", "raw turn 3"]
    assert await listed(store, limit=2, order="oldest") == ["raw turn 0", "raw turn 1"]
    reply = await store.ListMemories(store_pb2.ListMemoriesRequest(scope=scope(), limit=1))
    assert reply.total == 7
    assert await listed(store, layers=[L7, L3]) == ["call mom", "a fact"]
    assert await listed(store, exclude_layers=[L2]) == ["call mom", "a fact"]
    assert await listed(store, session_id="s2") == ["a fact"]
    assert await listed(store, extraction_status="pending", order="oldest") == [
        "raw turn 1",
        "raw turn 3",
    ]
    rows = (await store.ListMemories(
        store_pb2.ListMemoriesRequest(scope=scope(), order="oldest", limit=100)
    )).memories
    middle = rows[3].created_at
    assert await listed(store, created_after=middle, order="oldest", limit=100) == [
        r.content for r in rows if r.created_at > middle
    ]
    assert await listed(store, created_before=middle, order="oldest", limit=100) == [
        r.content for r in rows if r.created_at < middle
    ]
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
        await listed(store, order="sideways")


async def test_list_pages_on_by_cursor_without_repeats_or_skips_as_rows_come_and_go(
    store: store_pb2_grpc.StoreStub,
) -> None:
    notes = {m.content: m for m in await apply(store, *(insert(f"note {i}") for i in range(6)))}

    async def page(cursor: str, **kw: Any) -> store_pb2.ListMemoriesResponse:
        reply: store_pb2.ListMemoriesResponse = await store.ListMemories(
            store_pb2.ListMemoriesRequest(scope=scope(), limit=2, cursor=cursor, **kw)
        )
        return reply

    first = await page("")
    assert [m.content for m in first.memories] == ["note 5", "note 4"] and first.next_cursor
    await apply(store, insert("note 6"))  # offset 2 would repeat note 4
    second = await page(first.next_cursor)
    assert [m.content for m in second.memories] == ["note 3", "note 2"]
    for seen in ("note 3", "note 2"):  # offset 4 would skip note 1
        await apply(store, store_pb2.Op(
            retire=store_pb2.RetireOp(id=notes[seen].id, superseded_how="dropped")))
    third = await page(second.next_cursor)
    assert [m.content for m in third.memories] == ["note 1", "note 0"] and third.total == 5
    end = await page(third.next_cursor)
    assert list(end.memories) == [] and end.next_cursor == ""

    oldest = await page("", order="oldest")
    after = await page(oldest.next_cursor, order="oldest")
    assert [m.content for m in after.memories] == ["note 4", "note 5"]
    for bad in ("x", "1.5", "1.5:x", "1.5:-1", f"1.5:{2**63}"):
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
            await page(bad)


async def test_a_bad_op_in_the_middle_of_apply_leaves_nothing(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (kept,) = await apply(store, insert("kept fact"))
    bad_ops = [
        (grpc.StatusCode.NOT_FOUND, store_pb2.Op(retire=store_pb2.RetireOp(
            id="no-such-id", superseded_how="dropped"))),
        (grpc.StatusCode.INVALID_ARGUMENT, insert("   ")),
        (grpc.StatusCode.INVALID_ARGUMENT, insert("no layer", layer=common_pb2.LAYER_UNSPECIFIED)),
        (grpc.StatusCode.INVALID_ARGUMENT, insert("no owner", user="")),
        (grpc.StatusCode.INVALID_ARGUMENT, insert("bad json", metadata_json="{nope")),
        (grpc.StatusCode.INVALID_ARGUMENT, store_pb2.Op()),
    ]
    for code, bad in bad_ops:
        with raises_code(code):
            await apply(
                store,
                insert("first new row"),
                store_pb2.Op(update=store_pb2.UpdateOp(id=kept.id, content="changed")),
                bad,
                insert("last new row"),
            )
    assert await listed(store) == ["kept fact"]
    history = await store.GetHistory(store_pb2.GetHistoryRequest(scope=scope(), id=kept.id))
    assert [e.action for e in history.entries] == ["insert"]


async def test_retire_can_name_a_row_inserted_earlier_in_the_same_apply(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (old,) = await apply(store, insert("Alice lives in Paris"))
    new, retired = await apply(
        store,
        insert("Alice lives in Berlin", ref="move"),
        store_pb2.Op(
            retire=store_pb2.RetireOp(
                id=old.id, superseded_by="$move", superseded_how="updated", pass_id="p1"
            )
        ),
        actor="extractor",
    )
    assert retired.superseded_by == new.id
    assert retired.status == "retired" and retired.superseded_how == "updated"
    assert retired.retired_by == "extractor" and retired.pass_id == "p1"
    assert retired.HasField("invalid_at")
    assert await listed(store) == ["Alice lives in Berlin"]
    assert set(await listed(store, include_superseded=True)) == {
        "Alice lives in Berlin",
        "Alice lives in Paris",
    }
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
        await apply(
            store, store_pb2.Op(retire=store_pb2.RetireOp(
                id=new.id, superseded_how="replaced", superseded_by="$nothing"))
        )


async def test_a_replaced_row_ends_when_its_newer_version_says_the_change_happened(
    store: store_pb2_grpc.StoreStub,
) -> None:
    january, march = 1767225600.0, 1772323200.0  # 2026-01-01, 2026-03-01

    async def replaced(old: store_pb2.NewMemory, new: store_pb2.Op) -> float:
        (row,) = await apply(store, store_pb2.Op(insert=old))
        await apply(store, new, store_pb2.Op(retire=store_pb2.RetireOp(
            id=row.id, superseded_how="replaced", superseded_by="$new")))
        got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=row.id))
        return got.memory.invalid_at

    before = time.time()
    porto = insert("Lives in Porto", event_at=january).insert
    # "Moved to Lisbon in March", written later: Porto ended in March.
    assert await replaced(porto, insert("Lives in Lisbon", ref="new", event_at=march)) == march
    # A correction keeping the row's time, a newer version with no time or a time to come:
    # it ends now.
    for new in (insert("Lives in Porto, Portugal", ref="new", event_at=january),
                insert("Lives in Faro", ref="new"),
                insert("Will live in Faro", ref="new", event_at=time.time() + 86400)):
        assert await replaced(porto, new) >= before


async def test_a_row_is_not_restored_beside_a_live_version_of_it(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (paris,) = await apply(store, insert("Lives in Paris"))

    async def replace(old: str, text: str) -> str:
        new, _ = await apply(
            store,
            insert(text, ref="new"),
            store_pb2.Op(retire=store_pb2.RetireOp(
                id=old, superseded_how="replaced", superseded_by="$new")),
        )
        return new.id

    berlin = await replace(paris.id, "Lives in Berlin")
    rome = await replace(berlin, "Lives in Rome")
    restore = store_pb2.Op(restore=store_pb2.RestoreOp(id=paris.id))
    # The live end of the chain is named, whichever row of it is restored.
    for memory_id in (paris.id, berlin):
        with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as info:
            await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=memory_id)))
        assert f"its replacement {rome!r} is live: forget or delete it first" in (
            info.value.details() or "")
    assert await listed(store) == ["Lives in Rome"]

    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(
        id=rome, superseded_how="forgotten")))
    (back,) = await apply(store, restore)
    assert back.status == "active"
    assert await listed(store) == ["Lives in Paris"]
    # Paris's restore cleared its link to Berlin; Rome (forgotten) and Berlin (replaced by
    # Rome) still come after it, so neither comes back beside it, nor beside Paris's next
    # version, until that is forgotten.
    async def refused(live: str) -> None:
        for memory_id in (rome, berlin):
            with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as info:
                await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=memory_id)))
            assert f"{live!r} is that version live now: forget it first" in (
                info.value.details() or "")

    await refused(paris.id)
    lyon = await replace(paris.id, "Lives in Lyon")
    await refused(lyon)
    assert await listed(store) == ["Lives in Lyon"]
    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(
        id=lyon, superseded_how="forgotten")))
    (back,) = await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=rome)))
    assert back.status == "active"
    assert await listed(store) == ["Lives in Rome"]


async def test_a_retired_row_s_text_is_not_edited_in_place(
    store: store_pb2_grpc.StoreStub,
) -> None:
    old, new = await apply(
        store, insert("Lives in Porto", user="faro"), insert("Lives in Lisbon", user="faro"),
        user="faro",
    )
    retire = store_pb2.RetireOp(id=old.id, superseded_how="replaced", superseded_by=new.id)
    await apply(store, store_pb2.Op(retire=retire), user="faro")
    edit = store_pb2.Op(update=store_pb2.UpdateOp(id=old.id, content="Lives in Faro"))
    with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as info:
        await apply(store, edit, user="faro")
    assert "is retired: restore it before editing its text" in (info.value.details() or "")
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope("faro"), id=old.id))
    assert got.memory.content == "Lives in Porto"
    # What is not its text still changes (a search's usage feedback, say).
    (used,) = await apply(
        store, store_pb2.Op(update=store_pb2.UpdateOp(id=old.id, hits_delta=1)), user="faro"
    )
    assert used.hits == 1


async def restate_facts(stub: store_pb2_grpc.StoreStub, dry_run: bool) -> tuple[int, int]:
    """(duplicates, rows_superseded) of an admin dedupe_facts at 0.95."""
    reply = await stub.RestateFacts(store_pb2.RestateFactsRequest(threshold=0.95, dry_run=dry_run))
    return reply.duplicates, reply.rows_superseded


async def test_a_forgotten_fact_said_again_since_is_not_restored_beside_its_live_copy(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (bees,) = await apply(store, insert("Keeps bees on the roof"))
    (meeting,) = await apply(store, insert("Meeting with Sam at 3pm on Tuesday."))
    for row in (bees, meeting):
        await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=row.id))
    (again,) = await apply(store, insert("Keeps bees on the roof!", restates_at=0.92))
    # Within cosine 0.95 of the forgotten meeting (0.9705), but another time: another value.
    await apply(store, insert("Meeting with Sam at 4pm on Tuesday.", restates_at=0.92))
    with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as info:
        await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=bees.id)))
    assert f"its value was said again since, and {again.id!r} holds it live" in (
        info.value.details() or "")
    await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=meeting.id)))
    assert sorted(await listed(store)) == [
        "Keeps bees on the roof!",
        "Meeting with Sam at 3pm on Tuesday.",
        "Meeting with Sam at 4pm on Tuesday.",
    ]
    await apply(store, store_pb2.Op(delete=store_pb2.DeleteOp(id=again.id)))
    (back,) = await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=bees.id)))
    assert back.status == "active"


async def test_dedupe_facts_never_restates_one_agents_fact_by_anothers(
    store: store_pb2_grpc.StoreStub,
) -> None:
    await apply(store, insert("Lives in Lisbon", agent="phone"))
    await apply(store, insert("Lives in Lisbon.", agent="laptop"))
    await apply(store, insert("Keeps bees on the roof", agent="phone"))
    await apply(store, insert("Keeps bees on the roof.", agent="phone"))
    assert await restate_facts(store, dry_run=False) == (1, 1)
    assert sorted(await listed(store)) == [
        "Keeps bees on the roof.", "Lives in Lisbon", "Lives in Lisbon."]


async def test_dedupe_facts_counts_only_the_rows_it_retired(
    store: store_pb2_grpc.StoreStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    (older,) = await apply(store, insert("Keeps bees on the roof"))
    await apply(store, insert("Keeps bees on the roof."))
    forget = store_pb2.Op(retire=store_pb2.RetireOp(id=older.id, superseded_how="forgotten"))

    def forgotten_meanwhile(read: Any) -> Any:
        async def memory_vectors(self: Any, *args: Any) -> Any:
            vectors = await read(self, *args)
            await apply(store, forget)  # after the dedupe read the facts, before it writes
            return vectors

        return memory_vectors

    for repo_class in (repo_module.Repo, PgRepo):
        monkeypatch.setattr(
            repo_class, "memory_vectors", forgotten_meanwhile(repo_class.memory_vectors))
    assert await restate_facts(store, dry_run=False) == (1, 0)
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=older.id))
    assert got.memory.superseded_how == "forgotten"


async def test_retire_restore_update_delete_leave_an_audit_trail_that_outlives_the_row(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (row,) = await apply(store, insert("Bob likes tea"))
    (retired,) = await apply(
        store,
        store_pb2.Op(
            retire=store_pb2.RetireOp(id=row.id, superseded_how="dropped", drop_reason="stale")
        ),
        actor="consolidator",
        reason="cleanup",
    )
    assert retired.drop_reason == "stale" and retired.retired_by == "consolidator"
    (restored,) = await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=row.id)))
    assert restored.status == "active" and not restored.HasField("invalid_at")
    assert (restored.drop_reason, restored.retired_by, restored.superseded_how) == ("", "", "")
    (updated,) = await apply(
        store, store_pb2.Op(update=store_pb2.UpdateOp(id=row.id, hits=3, label="taste"))
    )
    assert (updated.hits, updated.label, updated.content) == (3, "taste", "Bob likes tea")
    (deleted,) = await apply(store, store_pb2.Op(delete=store_pb2.DeleteOp(id=row.id)))
    assert deleted == common_pb2.Memory()

    with raises_code(grpc.StatusCode.NOT_FOUND):
        await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=row.id))
    history = await store.GetHistory(store_pb2.GetHistoryRequest(scope=scope(), id=row.id))
    entries = list(history.entries)
    assert [e.action for e in entries] == ["insert", "retire", "restore", "update", "delete"]
    # The delete erased what the row and its reasons said; who did what, when, is kept.
    assert entries[1].actor == "consolidator" and entries[1].reason == ""
    assert json.loads(entries[1].before_json)["status"] == "active"
    assert json.loads(entries[1].after_json)["status"] == "retired"
    assert entries[-1].after_json == "" and json.loads(entries[-1].before_json)["hits"] == 3
    assert [e.seq for e in entries] == sorted(e.seq for e in entries)
    with raises_code(grpc.StatusCode.NOT_FOUND):
        await store.GetHistory(store_pb2.GetHistoryRequest(scope=scope("mallory"), id=row.id))


async def _as_stored_before_dates_were_checked(
    data_dir: Path, memory_id: str, store_backend: str
) -> None:
    """Gives a row dates off the calendar (as a store took them before it range-checked dates)
    and takes the store back to before it checked its dates."""
    await run_sql(
        data_dir,
        store_backend,
        f"UPDATE memories SET event_at = 1e13, due_at = -1e12 WHERE id = '{memory_id}'",
        f"DELETE FROM store_meta WHERE key = '{off_calendar.CHECKED}'",
    )


async def run_sql(data_dir: Path, store_backend: str, *statements: str) -> None:
    """Runs statements on the database of a stopped store in data_dir, on either backend."""
    if store_backend == "sqlite":
        with contextlib.closing(sqlite3.connect(data_dir / "hyatlas.db")) as db, db:
            for statement in statements:
                db.execute(statement)
        return
    conn = await asyncpg.connect(StoreBackend.dsn(data_dir))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def test_dates_stored_off_the_calendar_are_cleared_at_open_with_an_audit_entry(
    tmp_path: Path, embedder_address: str, store_backend: str
) -> None:
    dates = {"event_at": 1.7e9, "valid_to": 1.8e9, "due_at": 1.75e9}
    async with serving_store(tmp_path, embedder_address) as stub:
        (row,) = await apply(stub, insert("Ann renews her passport", layer=L7, **dates))
    await _as_stored_before_dates_were_checked(tmp_path, row.id, store_backend)

    async with serving_store(tmp_path, embedder_address) as stub:
        got = (await stub.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=row.id))).memory
        history = await stub.GetHistory(store_pb2.GetHistoryRequest(scope=scope(), id=row.id))
    assert not got.HasField("event_at") and not got.HasField("due_at")
    assert got.valid_to == 1.8e9 and got.content == "Ann renews her passport"
    assert [e.action for e in history.entries] == ["insert", "update"]
    cleared = history.entries[-1]
    assert cleared.actor == "store"
    assert cleared.reason == f"event_at, due_at {off_calendar.REASON}"
    before, after = json.loads(cleared.before_json), json.loads(cleared.after_json)
    assert (before["event_at"], before["due_at"]) == (1e13, -1e12)
    assert (after["event_at"], after["due_at"], after["valid_to"]) == (None, None, 1.8e9)


async def test_edge_dates_stored_off_the_calendar_are_cleared_at_open_once(
    tmp_path: Path, embedder_address: str, store_backend: str
) -> None:
    async with serving_store(tmp_path, embedder_address) as stub:
        raws = await apply(stub, *(insert(f"turn {n}", layer=L2) for n in range(2)))
        await apply(stub, store_pb2.Op(put_edge=store_pb2.PutEdgeOp(
            owner=common_pb2.Owner(user_id="alice"), subject="Ann", relation="lives in",
            object="Porto", source_ids=[r.id for r in raws], valid_from=1.7e9, valid_to=1.8e9)))
    # A store whose rows were checked before its edges were: only the edges' check is to come.
    await run_sql(
        tmp_path,
        store_backend,
        "UPDATE graph_edges SET valid_from = 1e13",
        f"DELETE FROM store_meta WHERE key = '{off_calendar.EDGES_CHECKED}'",
    )

    async with serving_store(tmp_path, embedder_address) as stub:
        (edge,) = (await stub.ListEdges(store_pb2.ListEdgesRequest(scope=scope()))).edges
    assert not edge.HasField("valid_from") and edge.valid_to == 1.8e9
    assert (edge.subject, edge.relation, edge.object) == ("Ann", "lives in", "Porto")
    # Once: a date off the calendar stored after the check is not looked for at the next open.
    await run_sql(tmp_path, store_backend, "UPDATE graph_edges SET valid_from = 1e13")
    async with serving_store(tmp_path, embedder_address) as stub:
        (edge,) = (await stub.ListEdges(store_pb2.ListEdgesRequest(scope=scope()))).edges
    assert edge.valid_from == 1e13


async def test_retiring_a_retired_row_is_a_conflict_and_its_apply_writes_nothing(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (row,) = await apply(store, insert("Bob likes tea"))
    forget = store_pb2.RetireOp(id=row.id, superseded_how="forgotten", drop_reason="asked")
    await apply(store, store_pb2.Op(retire=forget))
    # An edit that read the row before the forget: its new version and its retire.
    edit = store_pb2.RetireOp(id=row.id, superseded_how="replaced", superseded_by="$new")
    with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as info:
        await apply(store, insert("Bob likes green tea", ref="new"), store_pb2.Op(retire=edit))
    assert "retired already (forgotten)" in info.value.details()
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=row.id))
    assert (got.memory.superseded_how, got.memory.superseded_by) == ("forgotten", "")
    assert await listed(store, include_superseded=True) == ["Bob likes tea"]


@pytest.mark.sqlite_only
async def test_an_audit_entry_is_stored_without_default_fields_and_read_whole(
    store: store_pb2_grpc.StoreStub, tmp_path: Path
) -> None:
    (row,) = await apply(store, insert("Bob likes tea"))
    history = await store.GetHistory(store_pb2.GetHistoryRequest(scope=scope(), id=row.id))
    (entry,) = history.entries
    whole = json.loads(entry.after_json)
    assert whole["content"] == "Bob likes tea" and whole["status"] == "active"
    assert (whole["label"], whole["metadata"], whole["source_ids"], whole["event_at"]) == (
        "", {}, [], None)
    columns = {"metadata" if f == "metadata_json" else f for f in MemoryRow.__dataclass_fields__}
    assert set(whole) == columns
    db = sqlite3.connect(tmp_path / "hyatlas.db")
    (stored,) = db.execute("SELECT after_json FROM audit WHERE memory_id = ?", (row.id,)).fetchone()
    db.close()
    kept = json.loads(stored)
    assert kept["content"] == "Bob likes tea" and kept["id"] == row.id
    assert not {"label", "metadata", "source_ids", "event_at", "status"} & set(kept)
    assert {name: whole[name] for name in kept} == kept


async def test_deleting_a_correction_does_not_bring_back_what_it_replaced(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (old,) = await apply(store, insert("Carol is 30"))
    new, _ = await apply(
        store,
        insert("Carol is 31", ref="n"),
        store_pb2.Op(retire=store_pb2.RetireOp(
            id=old.id, superseded_how="replaced", superseded_by="$n")),
    )
    await apply(store, store_pb2.Op(delete=store_pb2.DeleteOp(id=new.id)))
    assert await listed(store) == []


async def test_a_fact_restates_only_a_fact_and_an_experience_only_an_experience(
    store: store_pb2_grpc.StoreStub,
) -> None:
    text, lesson = "Run the migrations before deploying", "task_experience"
    (fact,) = await apply(store, insert(text, restates_at=0.92))
    (first,) = await apply(store, insert(text, label=lesson, restates_at=0.92))
    (again,) = await apply(store, insert(text, label=lesson, restates_at=0.92))
    reply = await store.ListMemories(
        store_pb2.ListMemoriesRequest(scope=scope(), layers=[L3], include_superseded=True)
    )
    status = {m.id: (m.status, m.superseded_by) for m in reply.memories}
    assert status == {
        fact.id: ("active", ""), first.id: ("retired", again.id), again.id: ("active", "")
    }


async def test_a_fact_said_again_counts_the_times_the_one_it_restates_was_said(
    store: store_pb2_grpc.StoreStub,
) -> None:
    texts = ["Keeps bees on the roof", "Keeps bees on the roof!", "Keeps bees on the roof!!"]
    rows = [(await apply(store, insert(t, count=1, restates_at=0.92)))[0] for t in texts]
    # And the admin dedupe folds a count it finds in the same way.
    (twice,) = await apply(store, insert("Lives in Lisbon", count=2))
    (again,) = await apply(store, insert("Lives in Lisbon.", count=1))
    assert await restate_facts(store, dry_run=False) == (1, 1)
    counts = []
    for row in [*rows, twice, again]:
        got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=row.id))
        counts.append((got.memory.status, got.memory.count))
    assert counts == [
        ("retired", 1), ("retired", 2), ("active", 3), ("retired", 2), ("active", 3)]


async def test_a_fact_said_again_without_a_date_keeps_the_date_of_the_one_it_restates(
    store: store_pb2_grpc.StoreStub,
) -> None:
    march, may, text = 1772510400.0, 1778000000.0, "Adopted a grey cat named Miso"
    await apply(store, insert(text, event_at=march, utc_offset_minutes=-480))
    again_op = insert(f"{text}!", restates_at=0.92)
    request = store_pb2.ApplyRequest(scope=scope(), ops=[again_op], idempotency_key="k1")
    first, again = await store.Apply(request), await store.Apply(request)
    # The row answered, the one replayed and the one stored all carry the old date.
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=first.memories[0].id))
    for row in (first.memories[0], again.memories[0], got.memory):
        assert (row.event_at, row.utc_offset_minutes, row.count) == (march, -480, 2)
    assert again.replayed
    # A date of its own wins.
    (dated,) = await apply(store, insert(f"{text}!!", event_at=may, restates_at=0.92))
    assert (dated.event_at, dated.utc_offset_minutes, dated.count) == (may, 0, 3)


async def test_a_users_own_fact_restates_no_agents_fact_and_an_agents_restates_its_own(
    store: store_pb2_grpc.StoreStub,
) -> None:
    # As consolidation merges nothing across agents: one agent's facts are not another's.
    (coder,) = await apply(store, insert("Keeps bees in the garden", agent="coder",
                                         restates_at=0.92))
    await apply(store, insert("Keeps bees in the garden!", restates_at=0.92))
    assert sorted(await listed(store)) == ["Keeps bees in the garden", "Keeps bees in the garden!"]
    (again,) = await apply(store, insert("Keeps bees in the garden!!", agent="coder",
                                         restates_at=0.92))
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=coder.id))
    assert (got.memory.superseded_how, got.memory.superseded_by) == ("restated", again.id)


async def test_a_near_fact_with_another_number_or_word_restates_nothing(
    store: store_pb2_grpc.StoreStub,
) -> None:
    # Each pair lies within cosine 0.92 (0.9705 and 0.9501 with the model): two meetings, two
    # hiding places, not one value said twice.
    pairs = [
        ("Meeting with Sam at 3pm on Tuesday.", "Meeting with Sam at 4pm on Tuesday."),
        ("The spare key is under the blue flowerpot.", "The spare key is under the red flowerpot."),
    ]
    for first, second in pairs:
        await apply(store, insert(first, restates_at=0.92))
        await apply(store, insert(second, restates_at=0.92))
    await apply(store, insert("Keeps bees on the roof", restates_at=0.92))
    await apply(store, insert("Keeps bees on the roof!", restates_at=0.92))
    assert sorted(await listed(store)) == sorted(
        [text for pair in pairs for text in pair] + ["Keeps bees on the roof!"])
    # Nor does the dedupe pass (at 0.95) take one meeting for the other.
    assert await restate_facts(store, dry_run=False) == (0, 0)


async def test_another_owners_row_is_not_found_and_stays_unchanged(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (theirs,) = await apply(store, insert("Mallory's secret", user="mallory"), user="mallory")
    (agent_row,) = await apply(store, insert("agent note", agent="a1"))
    foreign_ops = [
        store_pb2.Op(delete=store_pb2.DeleteOp(id=theirs.id)),
        store_pb2.Op(retire=store_pb2.RetireOp(id=theirs.id, superseded_how="dropped")),
        store_pb2.Op(update=store_pb2.UpdateOp(id=theirs.id, content="pwned")),
    ]
    for op in foreign_ops:
        with raises_code(grpc.StatusCode.NOT_FOUND) as info:
            await apply(store, insert("mine"), op)
        assert info.value.details() == f"memory {theirs.id!r} not found"
    with raises_code(grpc.StatusCode.NOT_FOUND):
        await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=theirs.id))
    with raises_code(grpc.StatusCode.PERMISSION_DENIED):
        await apply(store, insert("planted", user="mallory"))
    # An agent-scoped call reaches only that agent's rows.
    with raises_code(grpc.StatusCode.NOT_FOUND):
        await store.GetMemory(
            store_pb2.GetMemoryRequest(scope=scope(agent="a2"), id=agent_row.id)
        )
    got = await store.GetMemory(
        store_pb2.GetMemoryRequest(scope=scope(agent="a1"), id=agent_row.id)
    )
    assert got.memory.content == "agent note"

    assert await listed(store, user="mallory") == ["Mallory's secret"]
    assert await listed(store) == ["agent note"]


async def claim(
    stub: store_pb2_grpc.StoreStub, name: str, holder: str, ttl_s: float
) -> tuple[bool, str]:
    reply = await stub.ClaimLease(
        store_pb2.ClaimLeaseRequest(name=name, holder=holder, ttl_s=ttl_s)
    )
    return reply.granted, reply.holder


async def test_a_lease_is_one_holders_until_released_or_expired(
    store: store_pb2_grpc.StoreStub,
) -> None:
    assert await claim(store, "pass", "a", 60) == (True, "a")
    assert await claim(store, "pass", "b", 60) == (False, "a")
    assert await claim(store, "pass/longer", "b", 60) == (True, "b")  # names never overlap
    assert await claim(store, "pass", "a", 60) == (True, "a")  # a renewal
    assert await claim(store, "pass", "b", 0) == (False, "a")  # only its holder releases it
    assert await claim(store, "pass", "a", 0) == (True, "")
    assert await claim(store, "pass", "b", 0.2) == (True, "b")

    async def expired() -> None:
        assert await claim(store, "pass", "c", 60) == (True, "c")

    await assert_eventually(expired)
    for name, holder, ttl_s in (
        ("pass", "", 60), ("pass", "a", -1), ("pass", "a", math.inf), ("pass", "a", 1e300),
        ("pass", "a", LEASE_TTL_MAX_S + 1), ("pa\x00ss", "a", 60), ("pass", "a" * 1000, 60),
    ):
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
            await claim(store, name, holder, ttl_s)
    assert await claim(store, "pass", "c", LEASE_TTL_MAX_S) == (True, "c")


async def test_a_conditional_state_op_changes_the_value_only_while_it_is_the_one_sent(
    store: store_pb2_grpc.StoreStub,
) -> None:
    # A Now page clears the request its rebuild read, in the page's own write: a request stored
    # after that read stays, and the page is written all the same.
    key = owner_key(NOW_ASKED, "alice", "")

    def asked(value: object, if_value: str | None = None) -> store_pb2.Op:
        return owner_state_op(NOW_ASKED, "alice", "", value, if_value)

    async def stored() -> dict[str, str]:
        reply = await store.GetState(store_pb2.GetStateRequest(prefix=key))
        return {v.key: v.value_json for v in reply.values}

    await apply(store, asked({"asked": "newer"}))
    page, _ = await apply(
        store, insert("Alice is moving house", layer=common_pb2.L4_SUMMARY),
        asked(None, if_value='{"asked":"read"}'),
    )
    assert page.status == "active"
    assert await stored() == {key: '{"asked":"newer"}'}
    await apply(store, asked({"asked": "set"}, if_value='{"asked":"read"}'))
    assert await stored() == {key: '{"asked":"newer"}'}
    await apply(store, asked({"asked": "set"}, if_value='{"asked":"newer"}'))
    assert await stored() == {key: '{"asked":"set"}'}
    await apply(store, asked(None, if_value='{"asked":"set"}'))
    assert await stored() == {}
    await apply(store, asked({"asked": "back"}, if_value='{"asked":"set"}'))  # not brought back
    assert await stored() == {}


async def test_an_owners_state_key_is_refused_unless_it_is_that_owners_within_the_scope(
    store: store_pb2_grpc.StoreStub,
) -> None:
    async def state() -> list[tuple[str, str]]:
        reply = await store.GetState(store_pb2.GetStateRequest(prefix=""))
        return [(v.key, v.value_json) for v in reply.values]

    before = await state()  # the store's own keys (its line_ids namespace)
    bobs = owner_state_op(NOW_ASKED, "bob", "", {"a": 1})
    with raises_code(grpc.StatusCode.PERMISSION_DENIED):
        await apply(store, insert("kept?"), bobs)
    not_hers = owner_state_op(NOW_ASKED, "alice", "", {"a": 1})
    not_hers.set_state.key = bobs.set_state.key
    server_wide = owner_state_op(NOW_ASKED, "alice", "", {"a": 1})
    server_wide.set_state.key = "lease/pass"
    for op in (not_hers, server_wide):
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
            await apply(store, insert("kept?"), op)
    assert await listed(store) == []
    assert await state() == before


async def test_a_caller_reaching_one_alias_sets_the_state_key_of_its_groups_first_id_only(
    tmp_path: Path, embedder_address: str
) -> None:
    # The Now page of an alias group is kept under its first id and drawn from every alias's
    # turns: an extraction under a token for one alias stores the group's request with the
    # turn's facts. The store refused it, so it was written apart, after the facts (a kill -9
    # between the two lost it).
    def as_token(name: str, user: str) -> tuple[tuple[str, str], ...]:
        grant = Grant.build(name, [user], ["*"], ["read", "write"])
        return ((GRANT_METADATA, grant.header()),)

    def write(user: str, owner: str) -> store_pb2.ApplyRequest:
        return store_pb2.ApplyRequest(scope=scope(user), ops=[
            insert(f"{user} asks for {owner}'s page", user=user),
            owner_state_op(NOW_ASKED, owner, "", {"asked": user}),
        ])

    aliases = Aliases((("bob", "bobby", "robert"),))
    async with serving_store(tmp_path, embedder_address, user_aliases=aliases) as stub:
        await stub.Apply(write("bobby", "bob"), metadata=as_token("bobby-app", "bobby"))
        # Not another alias's key (the services keep nothing there), nor for another user.
        for user, owner in (("bobby", "robert"), ("alice", "bob")):
            with raises_code(grpc.StatusCode.PERMISSION_DENIED):
                await stub.Apply(write(user, owner), metadata=as_token(f"{user}-app", user))
        reply = await stub.GetState(store_pb2.GetStateRequest(prefix=f"{NOW_ASKED}/"))
        assert {v.key: v.value_json for v in reply.values} == {
            owner_key(NOW_ASKED, "bob", ""): '{"asked":"bobby"}'
        }
        assert await listed(stub, user="bob") == ["bobby asks for bob's page"]
        assert await listed(stub) == []


async def test_a_live_fact_is_a_key_of_the_turn_it_cites_until_it_is_changed_or_erased(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    (turn,) = await apply(
        store,
        insert("We drove to the lake on Saturday and Mia brought her puppy.", layer=L2),
    )
    (elsewhere,) = await apply(store, insert("The dentist moved my cleaning to May.", layer=L2))
    learnt = "The user's sister Mia owns a beagle called Biscuit"

    async def turn_score(query: str) -> float:
        hits = await vector_hits(store, embedder, query, layers=[L2], k=5)
        return next(h.score for h in hits if h.memory.id == turn.id)

    before = await turn_score(learnt)
    (fact,) = await apply(store, insert(learnt, source_ids=[turn.id, "no-such-row"]))
    (fact_hit,) = await vector_hits(store, embedder, learnt, layers=[L3])
    assert fact_hit.score > before + 0.1
    assert await turn_score(learnt) == pytest.approx(fact_hit.score, abs=2e-3)
    # Only while the fact is live: retired, the turn is found by its own text alone.
    for op, expected in (
        (store_pb2.Op(retire=store_pb2.RetireOp(id=fact.id, superseded_how="forgotten")), before),
        (store_pb2.Op(restore=store_pb2.RestoreOp(id=fact.id)), fact_hit.score),
    ):
        await store.Apply(store_pb2.ApplyRequest(scope=scope(), ops=[op]))
        assert await turn_score(learnt) == pytest.approx(expected, abs=2e-3)
    # A row of another layer (a summary) citing a turn gives it no key.
    await apply(store, insert("Notes on pets", layer=common_pb2.L5_KNOWLEDGE,
                              source_ids=[elsewhere.id]))
    assert [h.memory.id for h in await vector_hits(store, embedder, "Notes on pets",
                                                   layers=[L2], k=1, min_score=0.9)] == []

    changed = "The user's sister Mia adopted a cat"
    update = store_pb2.UpdateOp(id=fact.id, content=changed)
    await store.Apply(store_pb2.ApplyRequest(scope=scope(), ops=[store_pb2.Op(update=update)]))
    # The old text's key is gone: the turn scores as its own text or the changed fact does.
    (now_hit,) = await vector_hits(store, embedder, learnt, layers=[L3])
    assert now_hit.score < fact_hit.score - 0.1
    assert await turn_score(learnt) == pytest.approx(max(before, now_hit.score), abs=2e-3)
    (changed_hit,) = await vector_hits(store, embedder, changed, layers=[L3])
    assert await turn_score(changed) == pytest.approx(changed_hit.score, abs=2e-3)

    erase = store_pb2.Op(delete=store_pb2.DeleteOp(id=fact.id))
    await store.Apply(store_pb2.ApplyRequest(scope=scope(), ops=[erase]))
    assert await turn_score(changed) < changed_hit.score - 0.1


def wide_name(start: int) -> str:
    """A name as long as a client may send (256 characters), each four bytes of UTF-8."""
    return "".join(chr(0x1F300 + (start + i) % 0x500) for i in range(MAX_NAME_CHARS))


async def test_names_as_long_and_wide_as_a_client_may_send_work_everywhere(
    store: store_pb2_grpc.StoreStub,
) -> None:
    user, agent, session = wide_name(0), wide_name(1), wide_name(2)
    owner = common_pb2.Scope(user_id=user, agent_id=agent)
    key = "k" * MAX_IDEMPOTENCY_KEY_CHARS
    for text in ("I paddle a red kayak on weekends", "The kayak needs a new seat"):
        op = insert(text, user=user, agent=agent, layer=L2, session=session)
        request = store_pb2.ApplyRequest(scope=owner, ops=[op], idempotency_key=key[1:] + text[:1])
        first, again = await store.Apply(request), await store.Apply(request)
        assert again.replayed and again.memories[0].id == first.memories[0].id

    rows = await store.ListMemories(store_pb2.ListMemoriesRequest(scope=owner))
    assert sorted(m.content for m in rows.memories) == [
        "I paddle a red kayak on weekends", "The kayak needs a new seat"
    ]
    assert {m.owner.session_id for m in rows.memories} == {session}
    found = await store.KeywordSearch(store_pb2.KeywordSearchRequest(scope=owner, query="kayak"))
    assert len(found.hits) == 2
    assert await claim(store, lease_name("extract", user, agent), "a", 60) == (True, "a")


class _RetiresBetweenPages:
    """A store stub whose first ListMemories is followed by the retirement of the first rows
    it listed."""

    def __init__(self, stub: store_pb2_grpc.StoreStub, count: int) -> None:
        self._stub, self._count = stub, count
        self.retired: list[str] = []

    async def ListMemories(self, request: Any, **call: Any) -> Any:  # noqa: N802
        reply = await self._stub.ListMemories(request, **call)
        if not self.retired:
            self.retired = [m.id for m in reply.memories[: self._count]]
            await apply(self._stub, *(
                store_pb2.Op(retire=store_pb2.RetireOp(id=i, superseded_how="dropped"))
                for i in self.retired
            ))
        return reply


async def test_reading_every_row_in_pages_misses_none_when_rows_before_leave_meanwhile(
    store: store_pb2_grpc.StoreStub,
) -> None:
    rows = await apply(store, *(insert(f"note {n}") for n in range(PAGE + 10)))
    listing = _RetiresBetweenPages(store, 5)
    read = await all_rows(listing, store_pb2.ListMemoriesRequest(scope=scope()), 30)  # type: ignore[arg-type]
    staying = {row.id for row in rows} - set(listing.retired)
    assert len(staying) == PAGE + 5 and staying <= {row.id for row in read}


@pytest.mark.parametrize("query", ["kayak", "the", ""])
async def test_a_negative_k_is_refused_whatever_the_query(
    store: store_pb2_grpc.StoreStub, query: str
) -> None:
    # A query with no term to look for ("the") answered OK with no hits.
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as info:
        await store.KeywordSearch(
            store_pb2.KeywordSearchRequest(scope=scope(), query=query, k=-1))
    assert "k must not be negative" in (info.value.details() or "")


@pytest.mark.parametrize("word", ["दुनिया", "ดนตรี", "naïve"])
async def test_a_word_written_with_combining_marks_is_found_by_keyword(
    store: store_pb2_grpc.StoreStub, word: str
) -> None:
    (row,) = await apply(store, insert(f"Notes ({word}) from the trip, kept for later"))
    await apply(store, insert("Another note from the trip"))
    reply = await store.KeywordSearch(store_pb2.KeywordSearchRequest(scope=scope(), query=word))
    assert [h.hit.memory.id for h in reply.hits] == [row.id]


@pytest.mark.parametrize(
    ("text", "query"),
    [
        ("Write to john.doe@example.com about it", "john.doe@example.com"),
        ("The docs are at https://example.org/guide?page=2", "example.org guide"),
        ("Pi is about 3.14159 they said", "3.14159"),
        ("Tom's café serves crème brûlée", "creme brulee"),
        ("Her ﬁnance notes are here", "finance"),
        ("I don't eat meat anymore", "don't"),
        ("We met again after the storm", "again after"),
    ],
)
async def test_a_keyword_query_finds_its_words_however_the_text_joins_them(
    store: store_pb2_grpc.StoreStub, text: str, query: str
) -> None:
    # Both backends split a text into words at punctuation, fold accents and keep every word,
    # as the query side makes its terms (PostgreSQL's parser kept an address, a URL or a
    # decimal as one token, and its English stop words such as "don", "again" and "after").
    (row,) = await apply(store, insert(text))
    await apply(store, insert("Another note from the trip"))
    reply = await store.KeywordSearch(store_pb2.KeywordSearchRequest(scope=scope(), query=query))
    assert [h.hit.memory.id for h in reply.hits] == [row.id]


async def test_longer_names_and_keys_are_refused_and_change_nothing(
    store: store_pb2_grpc.StoreStub,
) -> None:
    too_long = "n" * (MAX_NAME_CHARS + 1)
    # A NUL in an id is refused by both backends (PostgreSQL could not read the JSON list).
    with_nul_source = insert("b")
    with_nul_source.insert.source_ids.append("x\x00y")
    refused = [
        store_pb2.ApplyRequest(scope=scope(), ops=[insert("a"), with_nul_source]),
        store_pb2.ApplyRequest(scope=scope(), ops=[insert("a", user="a\x00b")]),
        store_pb2.ApplyRequest(scope=scope(too_long), ops=[insert("a", user=too_long)]),
        store_pb2.ApplyRequest(scope=scope(), ops=[insert("a", agent=too_long)]),
        store_pb2.ApplyRequest(scope=scope(), ops=[insert("a", session=too_long)]),
        store_pb2.ApplyRequest(
            scope=scope(), ops=[insert("a")], idempotency_key="k" * (MAX_IDEMPOTENCY_KEY_CHARS + 1)
        ),
        store_pb2.ApplyRequest(
            scope=scope(),
            ops=[insert("a"), state_op("s" * (MAX_KEY_CHARS + 1), {"a": 1})],
        ),
    ]
    for request in refused:
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
            await store.Apply(request)
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
        await store.ListMemories(store_pb2.ListMemoriesRequest(scope=scope(too_long)))
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
        await claim(store, "x" * (LEASE_NAME_MAX + 1), "a", 60)
    everyone = await store.ListMemories(store_pb2.ListMemoriesRequest(scope=scope(all_users=True)))
    assert list(everyone.memories) == []


async def test_what_an_import_would_refuse_apply_refuses_and_changes_nothing(
    store: store_pb2_grpc.StoreStub,
) -> None:
    # So that every row a caller writes comes back from the store's own export (and nothing
    # such a value would break, a count past int32 or a time past the calendar, is stored).
    (kept,) = await apply(store, insert("kept fact"))
    owner = common_pb2.Owner(user_id="alice")

    def edge(weight: float, pass_id: str = "") -> store_pb2.Op:
        return store_pb2.Op(put_edge=store_pb2.PutEdgeOp(owner=owner, subject="Ana",
            relation="paints", object="walls", weight=weight, pass_id=pass_id))

    def update(**fields: Any) -> store_pb2.Op:
        return store_pb2.Op(update=store_pb2.UpdateOp(id=kept.id, **fields))

    def retire(**fields: Any) -> store_pb2.Op:
        return store_pb2.Op(retire=store_pb2.RetireOp(id=kept.id, **fields))

    deep = '{"a":' * 40 + "1" + "}" * 40
    long_name = "p" * (MAX_NAME_CHARS + 1)
    edge_ended = store_pb2.Op(end_edge=store_pb2.EndEdgeOp(id="an-edge", pass_id=long_name))
    refused = [
        ([insert("a", count=-3)], "op 0: count must be a count"),
        ([update(hits=-7)], "op 0: hits must be a count"),
        ([insert("a", label="l" * (MAX_NAME_CHARS + 1))], "op 0: label has 257 characters"),
        ([insert("a", id="x\x00y")], "op 0: id 'x\\x00y' is not a usable memory id"),
        ([insert("a", id=" x ")], "op 0: id ' x ' has whitespace around it"),
        ([insert("a", metadata_json=deep)], "op 0: metadata_json is nested over 32 levels"),
        ([insert("a", metadata_json='{"k": "a\\u0000b"}')],
         "op 0: metadata_json may not hold a NUL character"),
        ([insert("a", metadata_json='{"k": "\\ud83d"}')], "is not valid Unicode"),
        ([update(metadata_json='{"\\ud800": 1}')], "is not valid Unicode"),
        ([insert("a", event_at=math.inf)], "op 0: event_at is not between the years 1 and 9999"),
        ([insert("a", due_at=1e20)], "op 0: due_at is not between the years 1 and 9999"),
        ([update(event_at=math.nan)], "op 0: event_at is not between the years 1 and 9999"),
        ([edge(math.nan)], "op 0: an edge's weight must be a finite number"),
        ([edge(-math.inf)], "op 0: an edge's weight must be a finite number"),
        ([insert("a", extraction_status="someday")], "op 0: extraction_status 'someday' is not"),
        ([update(extraction_status="Done")], "op 0: extraction_status 'Done' is not one of"),
        ([insert("a", write_mode="turbo")], "op 0: write_mode 'turbo' is not one of lite, pro"),
        ([retire()], "op 0: superseded_how is required for a retired row: one of replaced"),
        ([insert("a", pass_id="p\x00")], "op 0: pass_id may not hold a NUL character"),
        ([retire(superseded_how="dropped", pass_id=long_name)], "op 0: pass_id has 257 char"),
        ([edge(1.0, pass_id="p\x00")], "op 0: pass_id may not hold a NUL character"),
        ([edge_ended], "op 0: pass_id has 257 characters"),
    ]
    for ops, error in refused:
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
            await apply(store, *ops)
        assert error in (caught.value.details() or ""), (error, caught.value.details())
    for actor, error in (
        ("hacker\x00", "actor may not hold a NUL character"),
        ("a" * 1000, "actor has 1,000 characters; at most 256"),
    ):
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
            await apply(store, insert("a"), actor=actor)
        assert caught.value.details() == error
    for ops, request in (
        ([insert("a" * (MAX_TEXT_CHARS + 1))], {}),
        ([insert("a")], {"reason": "r" * (MAX_TEXT_CHARS + 1)}),  # import's limit on history
    ):
        with raises_code(grpc.StatusCode.OUT_OF_RANGE):
            await apply(store, *ops, **request)
    assert await listed(store) == ["kept fact"]
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=kept.id))
    assert (got.memory.metadata_json, got.memory.hits) == ("{}", 0)
    edges = await store.ListEdges(store_pb2.ListEdgesRequest(scope=scope()))
    assert list(edges.edges) == []


async def test_an_apply_of_more_ops_than_the_bound_is_refused_whole(
    store: store_pb2_grpc.StoreStub,
) -> None:
    # One Apply holds the single writer for all of its ops, so their number is bounded.
    (row,) = await apply(store, insert("a much used fact"))
    hit = store_pb2.Op(update=store_pb2.UpdateOp(id=row.id, hits_delta=1))
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
        await apply(store, *[hit] * (MAX_APPLY_OPS + 1))
    assert caught.value.details() == "an Apply takes at most 5,000 ops, got 5,001: split the write"
    await apply(store, *[hit] * MAX_APPLY_OPS)
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=row.id))
    assert got.memory.hits == MAX_APPLY_OPS


async def test_hits_stop_at_the_largest_count_and_the_row_stays_readable(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (row,) = await apply(store, insert("a much used fact"))
    for change in ({"hits": 2**31 - 1}, {"hits_delta": 1}):
        await apply(store, store_pb2.Op(update=store_pb2.UpdateOp(id=row.id, **change)))
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=row.id))
    assert got.memory.hits == 2**31 - 1
    await apply(store, store_pb2.Op(update=store_pb2.UpdateOp(id=row.id, hits_delta=-(2**31 - 1))))
    await apply(store, store_pb2.Op(update=store_pb2.UpdateOp(id=row.id, hits_delta=-5)))
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=row.id))
    assert got.memory.hits == 0


async def test_a_read_bounded_by_nan_or_a_score_past_a_cosine_is_refused(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    await apply(store, insert("Ana paints walls"))
    for request in (
        store_pb2.ListMemoriesRequest(scope=scope(), created_after=math.nan),
        store_pb2.ListMemoriesRequest(scope=scope(), created_before=math.inf),
    ):
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
            await store.ListMemories(request)
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
        await store.ListEdges(store_pb2.ListEdgesRequest(scope=scope(), as_of=math.nan))
    for start in (math.nan, -math.inf):
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
            await store.CountMemories(store_pb2.CountMemoriesRequest(
                scope=scope(), start=start, bucket_s=86400.0, buckets=1))
        assert caught.value.details() == "start must be a finite number (unix seconds)"
    for score in (math.nan, -5.0, 1.5):
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
            await vector_hits(store, embedder, "who paints", min_score=score)
        assert "is not a cosine" in (caught.value.details() or "")
    assert [h.memory.content for h in await vector_hits(store, embedder, "who paints")] == [
        "Ana paints walls"
    ]


async def test_neighbours_report_cosines_within_minus_one_and_one(
    store: store_pb2_grpc.StoreStub,
) -> None:
    # Vectors are kept at half precision, so not quite unit length: a text and its copy scored
    # up to 1.002.
    texts = [f"Ana paints walls {n}" for n in range(8)]
    rows = await apply(store, *(insert(text) for text in texts + texts))
    reply = await store.Neighbours(store_pb2.NeighboursRequest(
        scope=scope(), ids=[r.id for r in rows], k=1))
    scores = [link.score for link in reply.links]
    assert len(scores) == 16 and all(-1.0 <= score <= 1.0 for score in scores), scores


async def test_a_list_filter_no_row_could_hold_is_refused_not_answered_empty(
    store: store_pb2_grpc.StoreStub,
) -> None:
    # As label and contains are: an empty page would say no row matches, not that none can.
    await apply(store, insert("Ana paints walls"))
    for filters, error in (
        ({"session_id": "s\x00"}, "session_id may not hold a NUL character"),
        ({"session_id": "s" * 1000}, "session_id has 1,000 characters; at most 256"),
        ({"source_id": "x\x00"}, "source_id may not hold a NUL character"),
        ({"superseded_by": "x" * 1000}, "superseded_by has 1,000 characters; at most 256"),
        ({"extraction_status": "bogus"}, "list: extraction_status 'bogus' is not one of pending"),
    ):
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
            await listed(store, **filters)
        assert (caught.value.details() or "").startswith(error), caught.value.details()
    assert await listed(store, extraction_status="done") == []


async def test_a_memory_tool_forget_of_a_target_the_tool_has_not_is_refused(
    store: store_pb2_grpc.StoreStub,
) -> None:
    meta = json.dumps({"write_origin": "memory_tool", "target": "memory"})
    await apply(store, insert("Keeps the spare key under the blue pot", layer=L2,
                              metadata_json=meta))
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
        await store.Forget(store_pb2.ForgetRequest(
            scope=scope(), text="spare key", memory_tool=True, target="bogus"))
    assert caught.value.details() == (
        "target 'bogus' is not one of the memory tool's: memory, user")
    for target, forgotten in (("user", 0), ("memory", 1)):
        found = await store.Forget(store_pb2.ForgetRequest(
            scope=scope(), text="spare key", memory_tool=True, target=target))
        assert len(found.memories) == forgotten


async def test_free_text_holding_a_nul_is_refused_by_the_store_itself_and_changes_nothing(
    store: store_pb2_grpc.StoreStub,
) -> None:
    # The gateway refuses it too; a direct gRPC caller meets the same rule on either backend.
    (kept,) = await apply(store, insert("kept fact"))
    owner = common_pb2.Owner(user_id="alice")
    edge = store_pb2.PutEdgeOp(owner=owner, subject="Ana", relation="paints", object="a\x00b")
    refused = [
        ("op 1: content", [insert("another"), insert("a\x00b")]),
        ("op 0: label", [insert("a", label="a\x00b")]),
        ("op 0: subject", [store_pb2.Op(put_edge=store_pb2.PutEdgeOp(
            owner=owner, subject="a\x00b", relation="paints", object="walls"))]),
        ("op 1: object", [insert("a"), store_pb2.Op(put_edge=edge)]),
        ("op 0: content", [store_pb2.Op(update=store_pb2.UpdateOp(id=kept.id, content="a\x00b"))]),
        ("op 0: drop_reason", [store_pb2.Op(retire=store_pb2.RetireOp(
            id=kept.id, superseded_how="dropped", drop_reason="a\x00b"))]),
    ]
    for where, ops in refused:
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
            await apply(store, *ops)
        assert caught.value.details() == f"{where} may not hold a NUL character"
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
        await apply(store, insert("a"), reason="a\x00b")
    assert caught.value.details() == "reason may not hold a NUL character"
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
        await store.Forget(store_pb2.ForgetRequest(scope=scope(), text="kept\x00fact"))
    assert caught.value.details() == "text may not hold a NUL character"
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
        await store.KeywordSearch(store_pb2.KeywordSearchRequest(scope=scope(), query="kept\x00"))
    assert caught.value.details() == "query may not hold a NUL character"
    assert await listed(store) == ["kept fact"]
    found = await store.KeywordSearch(
        store_pb2.KeywordSearchRequest(scope=scope(), query="another")
    )
    assert list(found.hits) == []
    edges = await store.ListEdges(store_pb2.ListEdgesRequest(scope=scope()))
    assert edges.total == 0
    history = await store.GetHistory(store_pb2.GetHistoryRequest(scope=scope(), id=kept.id))
    assert [e.action for e in history.entries] == ["insert"]


async def test_an_export_page_is_one_moment_though_a_write_lands_between_its_reads(
    store: store_pb2_grpc.StoreStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    (row,) = await apply(store, insert("The boat is blue."))

    async def page() -> list[Any]:
        reply = await store.ExportPage(store_pb2.ExportPageRequest(scope=scope(), limit=10))
        return [json.loads(text) for text in reply.lines]

    before = await page()
    vectors_of = TransferRows.vectors_of

    async def after_a_write(self: TransferRows, memory_ids: Any) -> Any:
        # The page's rows are read; its vectors, keys and history are not yet.
        monkeypatch.setattr(TransferRows, "vectors_of", vectors_of)
        await apply(store, store_pb2.Op(update=store_pb2.UpdateOp(
            id=row.id, content="The boat is red.")))
        return await vectors_of(self, memory_ids)

    monkeypatch.setattr(TransferRows, "vectors_of", after_a_write)
    assert await page() == before
    (now,) = await page()
    assert now["memory"]["content"] == "The boat is red."
    assert [entry["action"] for entry in now["history"]] == ["insert", "update"]
    assert now["vector"] != before[0]["vector"]


async def test_a_scope_reaches_every_user_of_its_alias_group(
    tmp_path: Path, embedder_address: str, embedder: EmbedderClient
) -> None:
    async with serving_store(
        tmp_path, embedder_address, user_aliases=Aliases((("alice", "alice-discord"),))
    ) as stub:
        (a,) = await apply(stub, insert("Alice plays the violin"))
        (b,) = await apply(
            stub, insert("Alice sings in a choir", user="alice-discord"), user="alice-discord"
        )
        await apply(stub, insert("Bob plays the violin", user="bob"), user="bob")

        assert set(await listed(stub)) == {"Alice plays the violin", "Alice sings in a choir"}
        assert set(await listed(stub, user="alice-discord")) == set(await listed(stub))
        await stub.GetMemory(store_pb2.GetMemoryRequest(scope=scope("alice-discord"), id=a.id))
        hits = await vector_hits(stub, embedder, "musical instrument", k=5)
        assert {h.memory.id for h in hits} <= {a.id, b.id} and a.id in {h.memory.id for h in hits}
        keyword = await stub.KeywordSearch(
            store_pb2.KeywordSearchRequest(scope=scope("alice-discord"), query="violin")
        )
        assert [h.hit.memory.id for h in keyword.hits] == [a.id]
        with raises_code(grpc.StatusCode.NOT_FOUND):
            await stub.GetMemory(store_pb2.GetMemoryRequest(scope=scope("bob"), id=a.id))


# bob's rows: alice holds most rows (her window is the newest ids, estimated from the
# postings) or a small share (her window is found among her rows).
@pytest.mark.parametrize("bobs", [["tulips in a garden"], [f"garden {n}" for n in range(8)]])
async def test_a_relaxed_search_past_the_budget_ranks_the_newest_rows_and_rare_terms_anywhere(
    store: store_pb2_grpc.StoreStub, monkeypatch: pytest.MonkeyPatch, bobs: list[str]
) -> None:
    monkeypatch.setattr(keywords, "POSTING_BUDGET", 3)
    for text in bobs:
        await apply(store, insert(text, user="bob"), user="bob")
    names = {}
    for text in ("garden tulips", "garden hose", "garden shed", "garden gnome", "garden bench"):
        (row,) = await apply(store, insert(text))
        names[row.id] = text
    reply = await store.KeywordSearch(
        store_pb2.KeywordSearchRequest(scope=scope(), query="garden tulips", min_terms=1)
    )
    found = {names[h.hit.memory.id]: h.matched_terms for h in reply.hits}
    # "garden hose" is neither among the three newest nor holds the rare term; bob's row is
    # not alice's.
    assert found == {"garden tulips": 2, "garden shed": 1, "garden gnome": 1, "garden bench": 1}
    assert [h.hit.memory.content for h in reply.hits][0] == "garden tulips"


async def keyword_hits(
    stub: store_pb2_grpc.StoreStub, query: str, **kw: Any
) -> list[common_pb2.ScoredMemory]:
    reply = await stub.KeywordSearch(
        store_pb2.KeywordSearchRequest(scope=scope(), query=query, **kw)
    )
    return [found.hit for found in reply.hits]


async def test_a_relaxed_keyword_search_ranks_a_rarer_term_first_however_often_one_holds_common(
    store: store_pb2_grpc.StoreStub,
) -> None:
    filler = [insert(f"a note about nothing much, number {n}") for n in range(30)]
    common = [insert(f"she likes gardening on sundays, week {n}") for n in range(4)]
    await apply(store, *filler, *common)
    short, rare = await apply(
        store,
        insert("gardening, gardening, gardening"),
        insert(
            "after the long drive back from the coast we unpacked the car, cooked a late "
            "dinner, watched the rain for an hour and then I practised the violin for a while"
        ),
    )
    hits = await keyword_hits(store, "violin gardening", k=3, min_terms=1)
    # bm25 put the short text holding the common term three times first.
    assert [h.memory.id for h in hits[:2]] == [rare.id, short.id]


async def test_a_distinct_text_search_finds_k_texts_however_many_copies_one_text_has(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    # Past the first oversampled read of the vector index, so the wider reads run too.
    copies = [insert("I had coffee with Sam at the cafe.", layer=L2)] * 150
    await apply(store, *copies, insert("i had coffee  with SAM at the cafe.", layer=L2))
    await apply(
        store,
        insert("I had coffee with Sam at the cafe.", layer=L3),
        insert("I had coffee with Sam at the cafe and he is moving to Paris.", layer=L2),
        insert("Sam's cafe order is a coffee with oat milk.", layer=L2),
    )
    query = "coffee with Sam at the cafe"
    for hits in (
        await vector_hits(store, embedder, query, k=4, distinct_text=True),
        await keyword_hits(store, query, k=4, distinct_text=True, min_terms=1),
    ):
        # The same text in another layer (a fact) is another row; case and spacing are not.
        assert sorted((h.memory.layer, h.memory.content) for h in hits) == [
            (L2, "I had coffee with Sam at the cafe and he is moving to Paris."),
            (L2, "I had coffee with Sam at the cafe."),
            (L2, "Sam's cafe order is a coffee with oat milk."),
            (L3, "I had coffee with Sam at the cafe."),
        ]
    # Without distinct_text every copy is a hit of its own.
    copied = await vector_hits(store, embedder, query, k=4)
    assert {content_key(h.memory.content) for h in copied} == {
        "i had coffee with sam at the cafe."
    }


async def test_a_distinct_text_search_of_texts_that_never_repeat_finds_what_any_search_finds(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    places = ["cafe", "park", "museum", "harbour", "library", "market", "station", "garden"]
    names = ("Sam", "Ana", "Ben", "Priya")
    await apply(
        store, *(insert(f"I met {n} at the {p}.", layer=L2) for n in names for p in places)
    )

    async def searches(query: str, **kw: Any) -> list[list[common_pb2.ScoredMemory]]:
        return [
            await vector_hits(store, embedder, query, **kw),
            await keyword_hits(store, query, **kw),
            await keyword_hits(store, query, min_terms=1, **kw),
        ]

    for k in (1, 5, 40):
        for query in ("who did I meet at the cafe", "Sam at the museum"):
            assert await searches(query, k=k, distinct_text=True) == await searches(query, k=k)


def _spy(monkeypatch: pytest.MonkeyPatch, classes: tuple[type, ...], name: str,
         seen: list[Any]) -> None:
    """Records the arguments of each call of the method `name` of either backend's class."""
    for cls in classes:
        original = getattr(cls, name)

        async def spied(self: Any, *args: Any, _original: Any = original) -> Any:
            seen.append(args)
            return await _original(self, *args)

        monkeypatch.setattr(cls, name, spied)


async def test_a_distinct_keyword_search_reads_no_further_down_the_ranking_than_the_widest(
    store: store_pb2_grpc.StoreStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # More copies of one text than the widest read; the other text ranks below every copy.
    other = "I had coffee with Sam at the cafe and he is moving to Paris."
    await apply(store, *[insert("coffee with Sam", layer=L2)] * 150, insert(other, layer=L2))
    calls: list[Any] = []
    _spy(monkeypatch, (repo_module.Repo, PgRepo), "text_search", calls)

    async def found(widest: int) -> tuple[list[str], list[int]]:
        monkeypatch.setattr(retrieval, "WIDEST", widest)
        calls.clear()
        hits = await keyword_hits(store, "coffee with Sam", k=2, distinct_text=True, min_terms=1)
        return [h.memory.content for h in hits], [args[-1] for args in calls]  # rows asked

    assert await found(64) == (["coffee with Sam"], [2, 8, 32, 64])
    assert await found(1024) == (["coffee with Sam", other], [2, 8, 32, 128, 512])


async def test_a_distinct_vector_search_scores_the_keys_once_and_keeps_no_more_than_the_widest(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # More copies of one text than the widest read; the other text is less near than any copy.
    copy, other = "I had coffee with Sam at the cafe.", "I had coffee with Sam, he moves to Paris."
    await apply(store, *[insert(copy, layer=L2)] * 150, insert(other, layer=L2))
    scored: list[Any] = []  # each read of vectors to score exactly
    _spy(monkeypatch, (VectorIndexes, PgVectors), "vectors", scored)

    async def found(widest: int) -> tuple[list[str], int]:
        monkeypatch.setattr(retrieval, "WIDEST", widest)
        scored.clear()
        hits = await vector_hits(store, embedder, "coffee with Sam at the cafe", k=2,
                                 distinct_text=True)
        return [h.memory.content for h in hits], len(scored)

    # Repeats are not rows the filters leave out: a wider search reads past them to the other
    # text; once that reaches the widest, the keys are scored exactly at once, and only once.
    assert await found(64) == ([copy], 1)
    assert await found(1024) == ([copy, other], 0)


async def test_a_vector_search_by_ids_scores_those_rows_alone_by_their_nearest_key(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    """Rows another source found get their cosine: each as a search finds it (its nearest key,
    a sentence's here), best first; rows out of scope or layers are left out, as is a row that
    does not exist; more than 100 ids are refused."""
    rows = await apply(
        store,
        insert("Alice keeps bees on the roof. She also collects stamps from Peru and Chile."),
        insert("Alice drives a red tractor to the market"),
        insert("Alice said the stamps arrived from Lima today", layer=L2),
    )
    (bobs,) = await apply(store, insert("Bob collects stamps from Chile", user="bob"), user="bob")
    query = "stamps from South America"
    nearest = {h.memory.id: h.score for h in await vector_hits(store, embedder, query, k=10)}
    ids = [bobs.id, "no-such-row", *(row.id for row in rows)]

    scored = await vector_hits(store, embedder, query, ids=ids)
    assert [h.memory.id for h in scored] == sorted(nearest, key=lambda i: -nearest[i])
    # Against the same 8-bit vectors; a search quantizes the query too, this does not.
    expected = [nearest[h.memory.id] for h in scored]
    assert [h.score for h in scored] == pytest.approx(expected, abs=0.01)
    facts = await vector_hits(store, embedder, query, ids=ids, layers=[L3], k=1)
    assert [h.memory.id for h in facts] == [rows[0].id]
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as refused:
        await vector_hits(store, embedder, query, ids=[f"id-{i}" for i in range(101)])
    assert "at most 100 ids" in refused.value.details()


async def test_a_widened_vector_search_reads_each_key_and_each_row_once(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy, other = "I had coffee with Sam at the cafe.", "I had coffee with Sam, he moves to Paris."
    await apply(store, *[insert(copy, layer=L2)] * 150, insert(other, layer=L2))
    keys_read: list[Any] = []
    rows_read: list[Any] = []
    _spy(monkeypatch, (repo_module.Repo, PgRepo), "memories_of_keys", keys_read)
    _spy(monkeypatch, (repo_module.Repo, PgRepo), "get_many", rows_read)
    hits = await vector_hits(store, embedder, "coffee with Sam at the cafe", k=2,
                             distinct_text=True)
    assert [h.memory.content for h in hits] == [copy, other]
    # Past the copies takes wider passes; each reads only what the ones before it did not.
    assert len(keys_read) > 1
    keys = [key for (asked,) in keys_read for key in asked]
    assert len(keys) == len(set(keys)) >= 151
    ids = [memory_id for args in rows_read for memory_id in args[1]]
    assert len(ids) == len(set(ids))


@pytest.mark.sqlite_only
async def test_a_version_4_store_gets_the_writers_utc_offset_and_its_rows_read_in_utc(
    tmp_path: Path, embedder_address: str
) -> None:
    async with serving_store(tmp_path, embedder_address) as stub:
        await apply(stub, insert("Ivy said this before offsets were kept", layer=L2))
    db = sqlite3.connect(tmp_path / "hyatlas.db")
    # As version 4 left it: no writer's offset on a row.
    db.executescript(
        "ALTER TABLE memories DROP COLUMN utc_offset_minutes; DELETE FROM schema_version; "
        "INSERT INTO schema_version VALUES (4, 0);"
    )
    db.close()
    async with serving_store(tmp_path, embedder_address) as stub:
        (new,) = await apply(stub, insert("Ivy says this at 20:00 in LA", layer=L2,
                                          event_at=1772510400, utc_offset_minutes=-480))
        reply = await stub.ListMemories(
            store_pb2.ListMemoriesRequest(scope=scope(), order="oldest")
        )
        assert [(m.content, m.utc_offset_minutes) for m in reply.memories] == [
            ("Ivy said this before offsets were kept", 0), ("Ivy says this at 20:00 in LA", -480)
        ]
        assert new.utc_offset_minutes == -480
    db = sqlite3.connect(tmp_path / "hyatlas.db")
    assert db.execute("SELECT max(version) FROM schema_version").fetchone() == (SCHEMA_VERSION,)
    db.close()


@pytest.mark.sqlite_only
async def test_a_version_1_store_is_migrated_and_keeps_its_keyword_index(
    tmp_path: Path, embedder_address: str
) -> None:
    db = sqlite3.connect(tmp_path / "hyatlas.db")
    db.executescript((FIXTURES / "store_schema_v1.sql").read_text())
    db.execute("INSERT INTO schema_version VALUES (1, 0)")
    # Stores of 2026-12-02 to 12-05 kept this index of sentence keys, which no query reads now.
    db.execute("CREATE INDEX memory_keys_key_memory ON memory_keys(key, memory_id)")
    db.execute(
        "INSERT INTO memories (id, user_id, layer, content, created_at, updated_at) "
        "VALUES ('m1', 'alice', 'l2_raw', 'Ivy restores old clocks', 1, 1)"
    )
    db.execute(
        "INSERT INTO memory_keys (memory_id, kind, text) "
        "VALUES ('m1', 'context', 'before: a pendulum\nIvy restores old clocks')"
    )
    db.execute(
        "INSERT INTO graph_edges (id, user_id, subject, relation, object, recorded_at) "
        "VALUES ('e1', 'alice', 'Émile', 'Lives In', 'Évora', 1)"
    )
    db.commit()
    db.close()
    async with serving_store(tmp_path, embedder_address) as stub:
        reply = await stub.KeywordSearch(
            store_pb2.KeywordSearchRequest(
                scope=scope(), query="pendulum clocks", min_terms=1, context_keys=True
            )
        )
        assert [h.hit.memory.id for h in reply.hits] == ["m1"]
        assert [h.hit.memory.id for h in reply.context_hits] == ["m1"]
        other = await stub.KeywordSearch(
            store_pb2.KeywordSearchRequest(scope=scope("bob"), query="clocks")
        )
        assert list(other.hits) == []
        # An edge stored before its names had keys is found by its names in any case.
        await apply(stub, store_pb2.Op(put_edge=store_pb2.PutEdgeOp(
            owner=common_pb2.Owner(user_id="alice"), subject="émile", relation="LIVES IN",
            object="évora", source_ids=["m1"])))
        edges = await stub.ListEdges(store_pb2.ListEdgesRequest(scope=scope()))
        assert [(e.id, list(e.source_ids)) for e in edges.edges] == [("e1", ["m1"])]
    db = sqlite3.connect(tmp_path / "hyatlas.db")
    assert db.execute("SELECT max(version) FROM schema_version").fetchone() == (SCHEMA_VERSION,)
    # The FTS5 tables are gone: the keyword indexes are folders beside the database now.
    assert db.execute(
        "SELECT count(*) FROM sqlite_master WHERE name LIKE '%fts%'"
    ).fetchone() == (0,)
    assert (tmp_path / "keywords" / "own" / "meta.json").exists()
    # Tables added without a version step reach a migrated store too.
    assert db.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'idempotency_keys'"
    ).fetchone() == (1,)
    # So do indexes: a vector search maps its own keys to memories without reading their rows,
    # and its sentence keys by their rowid (their rows hold the text it needs).
    plan = db.execute(
        "EXPLAIN QUERY PLAN " + MEMORIES_OF_KEYS, ("[1]", 0, "clause", "[1]")
    ).fetchall()
    steps = [row[3] for row in plan]
    assert "SEARCH v USING COVERING INDEX vectors_key_memory (key=?)" in steps
    assert "SEARCH mk USING INTEGER PRIMARY KEY (rowid=?)" in steps
    # An index no query reads any more is gone from a store that had it.
    assert db.execute(
        "SELECT count(*) FROM sqlite_master WHERE name = 'memory_keys_key_memory'"
    ).fetchone() == (0,)
    # And a store counts its vectors' models at open without reading the vectors.
    plan = db.execute("EXPLAIN QUERY PLAN " + VECTOR_MODELS).fetchall()
    assert [row[3] for row in plan] == ["SCAN vectors USING COVERING INDEX vectors_model"]
    db.close()


def _keyword_doc_freq(data_dir: Path, name: str, term: str) -> int:
    """How many documents of a keyword index's files hold a term (deleted ones too)."""
    index = KeywordIndex(data_dir / "keywords" / name, SOURCES[name])
    return int(index.opened_at(index.folder).searcher().doc_freq("text", term))


async def _rebuilt_after_erase(data_dir: Path) -> None:
    """Waits till the keyword rebuild an erase started has ended (its mark is cleared)."""
    db = sqlite3.connect(data_dir / "hyatlas.db")
    try:
        await assert_eventually(
            lambda: db.execute(
                "SELECT count(*) FROM store_meta WHERE key = 'keywords_purge'"
            ).fetchone() == (0,)
        )
    finally:
        db.close()


@pytest.mark.sqlite_only
async def test_an_erase_leaves_no_term_of_the_deleted_text_in_the_keyword_index(
    tmp_path: Path, embedder_address: str
) -> None:
    async with serving_store(tmp_path, embedder_address) as stub:
        await apply(stub, insert("the zephyrine lighthouse keeper", layer=L2), insert("a fact"))
        found = await stub.KeywordSearch(
            store_pb2.KeywordSearchRequest(scope=scope(), query="zephyrine")
        )
        assert [h.hit.memory.content for h in found.hits] == ["the zephyrine lighthouse keeper"]
        reply = await stub.DeleteMemories(
            store_pb2.DeleteMemoriesRequest(scope=scope(), layers=[L2], actor="api")
        )
        assert reply.deleted == 1
        found = await stub.KeywordSearch(
            store_pb2.KeywordSearchRequest(scope=scope(), query="zephyrine")
        )
        assert list(found.hits) == []
        # A delete alone leaves the term in the segment's dictionary; the rebuild that the
        # erase starts behind it takes it out.
        await assert_eventually(
            lambda: _keyword_doc_freq(tmp_path, "own", keywords.stem("zephyrine")) == 0
        )
        assert _keyword_doc_freq(tmp_path, "own", keywords.stem("fact")) == 1
        await _rebuilt_after_erase(tmp_path)


@pytest.mark.sqlite_only
async def test_a_store_stopped_mid_build_waits_for_the_build_to_give_up_and_leaves_no_folder(
    tmp_path: Path, embedder_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, ended = threading.Event(), threading.Event()
    build = KeywordIndex._build

    def build_till_closing(index: KeywordIndex, rows: Any, high: int) -> Path:
        # The erase's rebuild holds on till the store is stopping, then goes on.
        started.set()
        try:
            while not index._closing and time.monotonic() < started_at + WAIT_CEILING_S:
                time.sleep(0.01)
            return build(index, rows, high)
        finally:
            ended.set()

    async with serving_store(tmp_path, embedder_address) as stub:
        await apply(stub, insert("the zephyrine lighthouse keeper", layer=L2))
        monkeypatch.setattr(KeywordIndex, "_build", build_till_closing)
        started_at = time.monotonic()
        await stub.DeleteMemories(
            store_pb2.DeleteMemoriesRequest(scope=scope(), layers=[L2], actor="api")
        )
        await assert_eventually(started.is_set)
    assert ended.is_set()  # the store's close waited for the build's thread
    assert not list((tmp_path / "keywords").glob("*.new-*"))
    # A build folder left by a store killed mid-build is removed when the next one opens.
    monkeypatch.setattr(KeywordIndex, "_build", build)
    left = tmp_path / "keywords" / "own.new-killed"
    left.mkdir()
    (left / "meta.json").write_text("{}")
    async with serving_store(tmp_path, embedder_address) as stub:
        assert not left.exists()
        found = await stub.KeywordSearch(
            store_pb2.KeywordSearchRequest(scope=scope(), query="zephyrine")
        )
        assert list(found.hits) == []


@pytest.mark.sqlite_only
async def test_the_keyword_indexes_catch_up_with_rows_written_while_they_were_behind(
    tmp_path: Path, embedder_address: str
) -> None:
    async with serving_store(tmp_path, embedder_address) as stub:
        await apply(stub, insert("an old harbour", layer=L2))
    # Rows that reached SQLite without the indexes applying them (a store killed between the
    # two commits), and an index folder lost.
    db = sqlite3.connect(tmp_path / "hyatlas.db")
    db.execute(
        "INSERT INTO memories (id, user_id, layer, content, created_at, updated_at) "
        "VALUES ('m9', 'alice', 'l2_raw', 'a marmalade cat', 1, 1)"
    )
    db.commit()
    db.close()
    shutil.rmtree(tmp_path / "keywords" / "context")
    async with serving_store(tmp_path, embedder_address) as stub:
        for query, content in (("marmalade", "a marmalade cat"), ("harbour", "an old harbour")):
            found = await stub.KeywordSearch(
                store_pb2.KeywordSearchRequest(scope=scope(), query=query, context_keys=True)
            )
            assert [h.hit.memory.content for h in found.hits] == [content]
        found = await stub.KeywordSearch(
            store_pb2.KeywordSearchRequest(scope=scope(), query="harbour", context_keys=True)
        )
        assert [h.hit.memory.content for h in found.context_hits] == ["an old harbour"]


@pytest.mark.sqlite_only
async def test_a_keyword_index_applies_the_log_as_it_stood_and_leaves_later_writes_to_the_next(
    tmp_path: Path, embedder_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only searches apply the log here: the background follower waits longer than the test.
    monkeypatch.setattr(repo_module, "FOLLOW_DELAY_S", 3600.0)
    apply_batch = KeywordIndex._apply
    applied: list[int] = []

    def apply_while_a_write_lands(index: KeywordIndex, ids: Any, rows: Any, upto: int) -> None:
        if index.source.name == "own" and not applied:
            # A write commits while the first batch is being applied.
            db = sqlite3.connect(tmp_path / "hyatlas.db")
            db.execute(
                "INSERT INTO memories (id, user_id, layer, content, created_at, updated_at) "
                "VALUES ('late', 'alice', 'l2_raw', 'a late note', 1, 1)"
            )
            db.commit()
            db.close()
        if index.source.name == "own":
            applied.append(len(rows))
        apply_batch(index, ids, rows, upto)

    async with serving_store(tmp_path, embedder_address) as stub:
        await apply(stub, insert("an early note", layer=L2))
        monkeypatch.setattr(KeywordIndex, "_apply", apply_while_a_write_lands)

        async def found() -> list[str]:
            reply = await stub.KeywordSearch(
                store_pb2.KeywordSearchRequest(scope=scope(), query="note", k=10)
            )
            return sorted(h.hit.memory.content for h in reply.hits)

        # The search applies what was committed when it began, in one batch, and returns.
        assert await found() == ["an early note"]
        assert applied == [1]
        # The write that landed meanwhile is the next search's to apply.
        assert await found() == ["a late note", "an early note"]
        assert applied == [1, 1]


@pytest.mark.sqlite_only
async def test_a_batch_that_fails_to_apply_leaves_nothing_behind_and_is_applied_by_the_next_follow(
    tmp_path: Path, embedder_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(repo_module, "FOLLOW_DELAY_S", 3600.0)
    add = text_index._add
    failed: list[bool] = []

    def add_then_fail_once(writer: Any, rows: Any) -> None:
        add(writer, rows)  # half a batch in the writer when it fails
        if not failed:
            failed.append(True)
            raise OSError("disk full")

    async with serving_store(tmp_path, embedder_address) as stub:
        await apply(stub, insert("an early note", layer=L2), insert("a second note", layer=L2))
        monkeypatch.setattr(text_index, "_add", add_then_fail_once)
        request = store_pb2.KeywordSearchRequest(scope=scope(), query="note", k=10)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.KeywordSearch(request)
        # The writer kept for the next batch holds nothing of the failed one: each row once.
        found = await stub.KeywordSearch(request)
        assert sorted(h.hit.memory.content for h in found.hits) == [
            "a second note",
            "an early note",
        ]
    assert _keyword_doc_freq(tmp_path, "own", keywords.stem("note")) == 2


@pytest.mark.sqlite_only
async def test_a_write_made_while_the_indexes_follow_in_the_background_is_applied_in_a_next_round(
    tmp_path: Path, embedder_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(repo_module, "FOLLOW_DELAY_S", 0.01)
    follow = KeywordIndex.follow
    wrote: list[bool] = []

    async with serving_store(tmp_path, embedder_address) as stub:

        async def follow_then_write(index: KeywordIndex, conn: Any, high: Any = None) -> None:
            await follow(index, conn, high)
            if index.source.name == "own" and not wrote:
                wrote.append(True)
                await apply(stub, insert("the zephyrine lighthouse keeper", layer=L2))

        monkeypatch.setattr(KeywordIndex, "follow", follow_then_write)
        await apply(stub, insert("an early note", layer=L2))
        # No search comes: the follower's next round applies the write, as it does any other.
        await assert_eventually(
            lambda: _keyword_doc_freq(tmp_path, "own", keywords.stem("zephyrine")) == 1
        )


@pytest.fixture
def writers_soon_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keyword indexes follow commits at once and let their writers go 50 ms after."""
    monkeypatch.setattr(repo_module, "FOLLOW_DELAY_S", 0.01)
    monkeypatch.setattr(repo_module, "WRITERS_IDLE_S", 0.05)


@pytest.mark.sqlite_only
@pytest.mark.usefixtures("writers_soon_idle")
async def test_the_keyword_indexes_let_their_writers_go_once_writes_stop_and_index_later_ones(
    tmp_path: Path, embedder_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    let_go = KeywordIndex.let_go
    released: list[KeywordIndex] = []

    async def noting(index: KeywordIndex) -> None:
        await let_go(index)
        released.append(index)

    monkeypatch.setattr(KeywordIndex, "let_go", noting)
    request = store_pb2.KeywordSearchRequest(scope=scope(), query="note", k=10)
    async with serving_store(tmp_path, embedder_address) as stub:
        await apply(stub, insert("an early note", layer=L2))
        # No other commit comes: once the follower applied the write, both indexes let go.
        await assert_eventually(
            lambda: {i.source.name for i in released} == {"context", "own"}
            and not any(i.holds_writer for i in released)
        )
        # The next write takes a writer again; the search finds it, as it finds the first.
        before = len(released)
        await apply(stub, insert("a later note", layer=L2))
        found = await stub.KeywordSearch(request)
        assert sorted(h.hit.memory.content for h in found.hits) == ["a later note", "an early note"]
        await assert_eventually(
            lambda: len(released) >= before + 2 and not any(i.holds_writer for i in released)
        )
    assert _keyword_doc_freq(tmp_path, "own", keywords.stem("note")) == 2


@pytest.mark.sqlite_only
@pytest.mark.usefixtures("writers_soon_idle")
async def test_a_search_does_not_wait_for_a_writer_let_go_when_the_index_holds_every_change(
    tmp_path: Path, embedder_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release, ended = threading.Event(), threading.Event(), threading.Event()
    end_writer = KeywordIndex._end_writer

    def held_end_writer(index: KeywordIndex) -> None:
        # The first writer let go waits here, in its thread, holding the index's lock.
        if index.source.name == "own" and index.holds_writer and not started.is_set():
            started.set()
            release.wait(WAIT_CEILING_S)
            ended.set()
        end_writer(index)

    monkeypatch.setattr(KeywordIndex, "_end_writer", held_end_writer)
    request = store_pb2.KeywordSearchRequest(scope=scope(), query="lighthouse", k=10)
    async with serving_store(tmp_path, embedder_address) as stub:
        await apply(stub, insert("the lighthouse keeper's log", layer=L2))
        await assert_eventually(started.is_set)
        try:
            found = await stub.KeywordSearch(request)
            # Answered while the writer was still being let go, not after it.
            assert not ended.is_set()
            assert [h.hit.memory.content for h in found.hits] == ["the lighthouse keeper's log"]
        finally:
            release.set()
        # Once the writer is let go, a later write takes a new one and is found too.
        await apply(stub, insert("a second lighthouse", layer=L2))
        found = await stub.KeywordSearch(request)
        assert len(found.hits) == 2


@pytest.mark.sqlite_only
async def test_the_change_log_is_pruned_once_the_indexes_hold_it(
    tmp_path: Path, embedder_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(repo_module, "PRUNE_EVERY", 2)
    async with serving_store(tmp_path, embedder_address) as stub:
        for n in range(6):
            await apply(stub, insert(f"note number {n}"))
            # A search of both indexes applies what is pending, so the next write may prune it.
            await stub.KeywordSearch(
                store_pb2.KeywordSearchRequest(scope=scope(), query="note", context_keys=True)
            )
        found = await stub.KeywordSearch(
            store_pb2.KeywordSearchRequest(scope=scope(), query="note", k=10)
        )
        assert len(found.hits) == 6
    db = sqlite3.connect(tmp_path / "hyatlas.db")
    left = db.execute("SELECT count(*) FROM text_changes").fetchone()[0]
    db.close()
    assert left <= 2


@pytest.mark.sqlite_only
async def test_a_row_written_during_a_rebuild_is_found_after_it_though_the_log_was_pruned(
    tmp_path: Path, embedder_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(repo_module, "PRUNE_EVERY", 1)
    started, release = threading.Event(), threading.Event()
    build = KeywordIndex._build

    def held_build(index: KeywordIndex, rows: Any, high: int) -> Path:
        if index.source.name == "own":
            started.set()
            release.wait(WAIT_CEILING_S)
        return build(index, rows, high)

    async with serving_store(tmp_path, embedder_address) as stub:
        await apply(stub, insert("the zephyrine lighthouse keeper", layer=L2))
        monkeypatch.setattr(KeywordIndex, "_build", held_build)
        await stub.DeleteMemories(  # an erase: the keyword indexes are rebuilt behind it
            store_pb2.DeleteMemoriesRequest(scope=scope(), layers=[L2], actor="api")
        )
        await assert_eventually(started.is_set)  # the rows are read, the build goes on
        await apply(stub, insert("a quokka on the ferry"))
        # The index in use applies the write, so the next write may prune its log row.
        await stub.KeywordSearch(
            store_pb2.KeywordSearchRequest(scope=scope(), query="quokka", context_keys=True)
        )
        await apply(stub, insert("another note"))
        release.set()
        await _rebuilt_after_erase(tmp_path)
        found = await stub.KeywordSearch(
            store_pb2.KeywordSearchRequest(scope=scope(), query="quokka")
        )
        assert [h.hit.memory.content for h in found.hits] == ["a quokka on the ferry"]


class LogInMemory:
    """The reads a keyword index makes of SQLite, from rows and a change log held here."""

    def __init__(self, source_rows: str) -> None:
        self.source_rows = source_rows
        self.changes: list[tuple[int, int]] = []
        self.rows: dict[int, tuple[int, str, str]] = {}

    def write(self, row_id: int, text: str) -> None:
        self.rows[row_id] = (row_id, text, "alice")
        self.changes.append((len(self.changes) + 1, row_id))

    async def execute_fetchall(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        if "sqlite_sequence" in sql:
            return [(len(self.changes),)] if self.changes else []
        if "FROM text_changes" in sql:
            after, high, _, limit = params
            return [c for c in self.changes if after < c[0] <= high][:limit]
        if sql == self.source_rows:
            return list(self.rows.values())
        return [self.rows[i] for i in json.loads(params[0]) if i in self.rows]


@pytest.mark.sqlite_only
async def test_a_follow_whose_caller_gives_up_keeps_the_index_till_its_batch_is_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = LogInMemory(SOURCES["own"].rows)
    index = KeywordIndex(tmp_path / "own", SOURCES["own"])
    await index.open(log)  # type: ignore[arg-type]
    log.write(7, "a quokka on the ferry")
    applied: list[int] = []
    entered, release = threading.Event(), threading.Event()
    real_apply = KeywordIndex._apply

    def held_apply(self: KeywordIndex, ids: Any, rows: Any, upto: int) -> None:
        applied.append(upto)
        entered.set()
        release.wait(WAIT_CEILING_S)
        real_apply(self, ids, rows, upto)

    monkeypatch.setattr(KeywordIndex, "_apply", held_apply)
    search = asyncio.create_task(index.follow(log))  # type: ignore[arg-type]
    await asyncio.to_thread(entered.wait, WAIT_CEILING_S)
    search.cancel()  # the search's deadline passed while its batch is applied
    with pytest.raises(asyncio.CancelledError):
        await search
    later = asyncio.create_task(index.follow(log))  # type: ignore[arg-type]
    for _ in range(50):
        await asyncio.sleep(0)
    release.set()
    await later
    assert applied == [1]  # once: the later search waited for the batch in hand
    assert index.applied == 1
    await index.close()


def test_the_keyword_indexes_stem_a_word_as_matched_terms_does() -> None:
    words = "walking happiness ponies relational generously skies agreed hoping dancing running"
    terms = KeywordIndex(Path("unused"), SOURCES["own"]).terms(words.split())
    assert terms == [keywords.stem(word) for word in words.split()]


async def test_keyword_search_needs_all_of_three_terms_and_three_of_four(
    store: store_pb2_grpc.StoreStub,
) -> None:
    contents = {
        "all": "the red fox jumps over a wall",
        "two": "a red fox sleeps",
        "one": "red paint",
    }
    ids = {}
    for name, text in contents.items():
        (row,) = await apply(store, insert(text))
        ids[row.id] = name

    async def search(query: str) -> tuple[list[tuple[str, int]], store_pb2.KeywordSearchResponse]:
        reply = await store.KeywordSearch(
            store_pb2.KeywordSearchRequest(scope=scope(), query=query)
        )
        return [(ids[h.hit.memory.id], h.matched_terms) for h in reply.hits], reply

    found, reply = await search("red fox jumping")
    assert found == [("all", 3)] and reply.required_terms == 3
    found, reply = await search("Red fox jumps wall")
    assert list(reply.terms) == ["red", "fox", "jumps", "wall"] and reply.required_terms == 3
    assert found == [("all", 4)]
    found, reply = await search("red fox jumps moon")
    assert found == [("all", 3)]
    found, reply = await search("red fox sleeps moon")
    assert found == [("two", 3)]
    found, reply = await search("the and of")
    assert found == [] and list(reply.terms) == [] and reply.required_terms == 0
    found, reply = await search("red")
    assert sorted(name for name, _ in found) == ["all", "one", "two"]
    assert all(hit.hit.score > 0 for hit in reply.hits)


async def test_a_strict_search_past_the_budget_finds_an_old_row_holding_enough_terms(
    store: store_pb2_grpc.StoreStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The newest window is taken among the rows holding three of the four terms, so newer rows
    # that hold one common term each do not crowd out an older row that holds three. (Bob's
    # rows make alice's a small share: her window is then found among her rows.)
    monkeypatch.setattr(keywords, "POSTING_BUDGET", 3)
    for n in range(20):
        await apply(store, insert(f"weather report {n}", user="bob"), user="bob")
    (old,) = await apply(store, insert("harbor lantern festival"))
    for word in ("harbor", "lantern", "festival"):
        for n in range(4):
            await apply(store, insert(f"{word} note {n}"))
    reply = await store.KeywordSearch(
        store_pb2.KeywordSearchRequest(scope=scope(), query="harbor lantern festival zeppelin")
    )
    assert [(h.hit.memory.id, h.matched_terms) for h in reply.hits] == [(old.id, 3)]


@pytest.mark.parametrize("few", [0, FEW_PASSING], ids=["many pass", "few pass"])
async def test_a_keyword_search_of_a_layer_finds_its_few_rows_behind_many_of_another(
    store: store_pb2_grpc.StoreStub, monkeypatch: pytest.MonkeyPatch, few: int
) -> None:
    # With few rows in the layers asked for, SQLite's search looks among those rows only; the
    # rows found are the same either way.
    monkeypatch.setattr(fulltext, "FEW_PASSING", few)
    await apply(store, *[insert(f"harbor lantern festival night {n}", layer=L2) for n in range(40)])
    best, other, _ = await apply(
        store,
        insert("the harbor lantern festival was lovely"),
        insert("a lantern by the harbor"),
        insert("tax forms"),
    )

    async def found(**request: Any) -> list[tuple[str, int]]:
        reply = await store.KeywordSearch(
            store_pb2.KeywordSearchRequest(
                scope=scope(), query="harbor lantern festival", layers=[L3], **request
            )
        )
        return [(h.hit.memory.id, h.matched_terms) for h in reply.hits]

    assert await found() == [(best.id, 3)]
    assert await found(min_terms=1) == [(best.id, 3), (other.id, 2)]
    assert await found(min_terms=2, k=1) == [(best.id, 3)]


@pytest.mark.parametrize(
    "query",
    [
        '"unbalanced quote',
        "fox AND OR NOT",
        "fox*",
        "NEAR(fox wall)",
        "content: fox",
        "-fox ^wall",
        "(fox",
        "fox's wall; DROP TABLE memories; --",
        "{fox} [wall]",
        "",
    ],
)
async def test_keyword_query_syntax_characters_never_error(
    store: store_pb2_grpc.StoreStub, query: str
) -> None:
    await apply(store, insert("fox wall"))
    reply = await store.KeywordSearch(store_pb2.KeywordSearchRequest(scope=scope(), query=query))
    assert all(h.hit.memory.content == "fox wall" for h in reply.hits)
    assert await listed(store) == ["fox wall"]


async def test_vector_search_drops_hits_below_min_score_and_respects_filters(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    await apply(
        store,
        insert("The user's favourite food is sushi"),
        insert("The quarterly tax report is due in April", layer=L7),
        insert("raw: we talked about sushi", layer=L2),
    )
    everything = await vector_hits(store, embedder, "what food do I like", k=10)
    assert len(everything) == 3
    assert [h.score for h in everything] == sorted((h.score for h in everything), reverse=True)
    floor = (everything[0].score + everything[-1].score) / 2
    floored = await vector_hits(store, embedder, "what food do I like", k=10, min_score=floor)
    assert 0 < len(floored) < 3 and all(h.score >= floor for h in floored)
    facts = await vector_hits(store, embedder, "what food do I like", layers=[L3, L7])
    assert {h.memory.layer for h in facts} == {L3, L7}
    assert await vector_hits(store, embedder, "what food do I like", user="bob") == []


@pytest.mark.sqlite_only  # the SQLite store's usearch indexes (PgVectors has its own path)
@pytest.mark.parametrize(
    ("widest", "few", "scored_exactly"),
    [(64, 0, True), (retrieval.WIDEST, 0, False), (retrieval.WIDEST, FEW_PASSING, True)],
    ids=["scored at the widest", "widened", "few pass"],
)
async def test_a_filtered_vector_search_finds_the_few_rows_that_pass_behind_nearer_ones(
    tmp_path: Path,
    embedder_address: str,
    embedder: EmbedderClient,
    monkeypatch: pytest.MonkeyPatch,
    widest: int,
    few: int,
    scored_exactly: bool,
) -> None:
    # Raw rows nearer the query than any fact fill the first 64 keys an index search gives.
    # The three facts that pass the filter are scored exactly once the search has widened as
    # far as it may, or at once when no more than `few` rows pass; else widening finds them.
    monkeypatch.setattr(retrieval, "WIDEST", widest)
    monkeypatch.setattr(retrieval, "FEW_PASSING", few)
    monkeypatch.setattr(retrieval, "EXACT_CHUNK", 1)  # every passing key scored, one at a time
    scored_all = []
    exact = retrieval._exact

    async def spied(*args: Any) -> Any:
        scored_all.append(True)
        return await exact(*args)

    monkeypatch.setattr(retrieval, "_exact", spied)
    query = "what food do I like"
    facts = [
        "The user's favourite food is sushi",
        "The user cooks ramen on Sundays",
        "The quarterly tax report is due in April",
    ]
    async with serving_store(tmp_path, embedder_address, exact_search_up_to=0) as store:
        await apply(store, *[insert(f"{query}? take {i}", layer=L2) for i in range(300)])
        ids = [m.id for m in await apply(store, *[insert(fact) for fact in facts])]
        hits = await vector_hits(store, embedder, query, layers=[L3], k=2)

    asked, _ = await embedder.embed([query], is_query=True)
    stored, _ = await embedder.embed(facts, is_query=False)
    cosines = stored @ asked[0] / np.linalg.norm(stored, axis=1)
    assert [h.memory.id for h in hits] == [ids[i] for i in np.argsort(-cosines)[:2]]
    assert scored_all == ([True] if scored_exactly else [])


async def test_vector_search_with_another_model_is_refused(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    await apply(store, insert("anything"))
    with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as info:
        await vector_hits(store, embedder, "anything", model_id="some-other-model")
    assert "some-other-model" in (info.value.details() or "")


async def test_content_update_re_embeds_the_row(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    row, _ = await apply(store, insert("Dana drives a red bicycle"), insert("unrelated: stocks"))
    await apply(
        store,
        store_pb2.Op(update=store_pb2.UpdateOp(id=row.id, content="Dana cooks spicy curry")),
    )
    hits = await vector_hits(store, embedder, "curry dinner", k=1)
    assert hits[0].memory.id == row.id and hits[0].memory.content == "Dana cooks spicy curry"
    keyword = await store.KeywordSearch(
        store_pb2.KeywordSearchRequest(scope=scope(), query="bicycle")
    )
    assert list(keyword.hits) == []


async def test_filtered_search_in_a_large_owner_still_finds_the_rare_layer(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    """A filter that the oversampled nearest rows do not satisfy falls back to scoring them all."""
    for start in range(0, 1200, 200):
        await apply(
            store,
            *[
                insert(f"turn {i}: the weather was mild today", layer=L2)
                for i in range(start, start + 200)
            ],
        )
    (fact,) = await apply(store, insert("The user is allergic to peanuts"))
    await apply(store, insert("Peanut butter is tasty", user="bob"), user="bob")

    hits = await vector_hits(store, embedder, "weather", k=5, layers=[L3])
    assert [h.memory.id for h in hits] == [fact.id]
    hits = await vector_hits(store, embedder, "peanut allergy", k=3)
    assert hits[0].memory.id == fact.id and all(h.memory.owner.user_id == "alice" for h in hits)
    all_hits = await vector_hits(store, embedder, "peanut", k=3, scope=scope("", all_users=True))
    assert {h.memory.owner.user_id for h in all_hits} == {"alice", "bob"}


async def test_approximate_search_keeps_to_scope_and_falls_back_for_rare_layers(
    tmp_path: Path, embedder_address: str, embedder: EmbedderClient
) -> None:
    subjects = ["my sister", "the neighbour", "our manager", "a colleague", "my uncle",
                "the landlord", "my best friend", "the coach", "grandma", "the dentist"]
    doings = ["bought a new car", "moved to Lisbon", "started learning piano", "ran a marathon",
              "adopted a puppy", "got married", "lost their keys", "painted the kitchen",
              "wrote a novel", "planted tomatoes", "broke a leg", "opened a bakery",
              "visited Japan", "fixed the roof", "won a chess match"]
    async with serving_store(tmp_path, embedder_address, exact_search_up_to=50) as stub:
        await apply(stub, *[insert(f"{s} {d}", layer=L2) for s in subjects for d in doings])
        (fact,) = await apply(stub, insert("The user is allergic to peanuts"))
        await apply(stub, insert("Peanut allergy is common in kids", user="bob"), user="bob")

        hits = await vector_hits(stub, embedder, "a trip to Japan", k=5, layers=[L3])
        assert [h.memory.id for h in hits] == [fact.id]
        hits = await vector_hits(stub, embedder, "peanut allergy", k=10)
        assert hits[0].memory.id == fact.id
        assert len(hits) == 10 and all(h.memory.owner.user_id == "alice" for h in hits)
        hits = await vector_hits(stub, embedder, "who visited Japan", k=3, layers=[L2])
        assert "visited Japan" in hits[0].memory.content


async def test_delete_memories_erases_only_the_scope(store: store_pb2_grpc.StoreStub) -> None:
    await apply(store, insert("a raw", layer=L2), insert("a fact"))
    await apply(store, insert("bob fact", user="bob"), user="bob")
    reply = await store.DeleteMemories(
        store_pb2.DeleteMemoriesRequest(scope=scope(), layers=[L2], actor="api")
    )
    assert reply.deleted == 1
    assert await listed(store) == ["a fact"]
    reply = await store.DeleteMemories(store_pb2.DeleteMemoriesRequest(scope=scope()))
    assert reply.deleted == 1 and await listed(store) == []
    assert await listed(store, user="bob") == ["bob fact"]
    reply = await store.DeleteMemories(
        store_pb2.DeleteMemoriesRequest(scope=scope("", all_users=True))
    )
    assert reply.deleted == 1 and await listed(store, user="bob") == []
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
        await store.DeleteMemories(store_pb2.DeleteMemoriesRequest(scope=scope("")))


async def test_stats_count_live_rows_per_layer_and_unextracted_raw_rows(
    store: store_pb2_grpc.StoreStub,
) -> None:
    raw, _, _, fact = await apply(
        store,
        insert("turn one", layer=L2, extraction_status="pending"),
        insert("turn two", layer=L2, extraction_status="failed"),
        insert("turn three", layer=L2, extraction_status="done"),
        insert("a fact"),
    )
    await apply(store, store_pb2.Op(
        retire=store_pb2.RetireOp(id=fact.id, superseded_how="dropped")))
    await apply(store, insert("bob's", user="bob"), user="bob")
    stats = await store.GetStats(store_pb2.GetStatsRequest(scope=scope()))
    assert dict(stats.layers)["l2_raw"] == 3 and dict(stats.layers)["l3_fact"] == 0
    assert set(stats.layers) == {
        "l1_profile", "l2_raw", "l3_fact", "l4_summary",
        "l5_knowledge", "l6_schema", "l7_intention", "l8_entity",
    }
    assert (stats.total, stats.unextracted, stats.retired, stats.vectors) == (3, 2, 1, 4)
    assert stats.model_id and stats.ndim == 384 and stats.db_bytes > 0 and stats.data_dir
    everyone = await store.GetStats(store_pb2.GetStatsRequest(scope=scope("", all_users=True)))
    assert everyone.total == 4 and everyone.vectors == 5
    flushed = await store.Flush(store_pb2.FlushRequest())
    assert flushed.vectors == 5
    assert raw.extraction_status == "pending"
    # A turn given up on (three failed tries) is no longer counted: catch-up passes it over.
    (given_up,) = await apply(store, insert("turn four", layer=L2, extraction_status="failed"))
    await apply(store, store_pb2.Op(
        update=store_pb2.UpdateOp(id=given_up.id, extraction_tries=EXTRACTION_TRIES)))
    stats = await store.GetStats(store_pb2.GetStatsRequest(scope=scope()))
    assert (stats.total, stats.unextracted) == (4, 2)
    # Nor is one written before unextracted_after (too old for catch-up to take).
    since = await store.GetStats(store_pb2.GetStatsRequest(
        scope=scope(), unextracted_after=time.time()))
    assert (since.total, since.unextracted) == (4, 0)


async def test_a_listing_may_leave_out_turns_tried_that_many_times(
    store: store_pb2_grpc.StoreStub,
) -> None:
    for n in range(3):
        await apply(
            store,
            insert(f"turn {n}", layer=L2, extraction_status="failed", ref="t"),
            store_pb2.Op(update=store_pb2.UpdateOp(id="$t", extraction_tries=n)),
        )

    async def listed_below(tries_below: int) -> list[str]:
        return await listed(store, layers=[L2], order="oldest", tries_below=tries_below)

    assert await listed_below(0) == ["turn 0", "turn 1", "turn 2"]
    assert await listed_below(2) == ["turn 0", "turn 1"]
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as info:
        await listed_below(-1)
    assert "tries_below must not be negative" in (info.value.details() or "")


async def test_a_listing_may_keep_only_turns_written_in_some_modes(
    store: store_pb2_grpc.StoreStub,
) -> None:
    for mode in ("lite", "pro", "ultra", ""):
        await apply(store, insert(f"turn {mode or 'before modes'}", layer=L2, write_mode=mode))

    async def listed_in(*modes: str) -> list[str]:
        return await listed(store, layers=[L2], order="oldest", write_modes=list(modes))

    assert await listed_in() == ["turn lite", "turn pro", "turn ultra", "turn before modes"]
    assert await listed_in("pro", "ultra") == ["turn pro", "turn ultra"]
    assert await listed_in("") == ["turn before modes"]
    with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as info:
        await listed_in("turbo")
    assert "write_mode 'turbo' is not one of lite, pro, ultra" in (info.value.details() or "")


@pytest.mark.sqlite_only
@pytest.mark.usefixtures("usearch_indexes")
async def test_a_deleted_index_file_is_rebuilt_from_sqlite(
    tmp_path: Path, embedder_address: str, embedder: EmbedderClient
) -> None:
    async with serving_store(tmp_path, embedder_address) as stub:
        (row,) = await apply(stub, insert("Erin collects vintage stamps"))
        await vector_hits(stub, embedder, "stamps")  # loads (and so keeps) Erin's index
    files = list((tmp_path / "vectors").glob("*.usearch"))
    assert len(files) == 1
    files[0].unlink()
    async with serving_store(tmp_path, embedder_address) as stub:
        hits = await vector_hits(stub, embedder, "stamp collection")
        assert [h.memory.id for h in hits] == [row.id]
    assert files[0].exists()


@pytest.mark.sqlite_only
@pytest.mark.usefixtures("usearch_indexes")
async def test_an_index_file_of_half_precision_is_rebuilt_at_8_bits_from_sqlite(
    tmp_path: Path, embedder_address: str, embedder: EmbedderClient
) -> None:
    async with serving_store(tmp_path, embedder_address, save_every_s=None) as stub:
        (stamps,) = await apply(stub, insert("Erin collects vintage stamps"))
        (boat,) = await apply(stub, insert("Erin owns a sailboat"))
        await vector_hits(stub, embedder, "stamps")
        await stub.Flush(store_pb2.FlushRequest())
    (path,) = (tmp_path / "vectors").glob("*.usearch")
    saved = read_index_file(path)
    assert saved is not None and saved.dtype == ScalarKind.I8
    keys = np.asarray(saved.keys)
    vectors = np.array(saved.get(keys, dtype="f32"))
    # An older store's file: half precision, and (to tell it from a rebuilt one) each key
    # holding the other row's vector.
    older = Index(ndim=saved.ndim, metric="cos", dtype="f16")
    older.add(keys, vectors[::-1].copy())
    older.save(str(path))
    async with serving_store(tmp_path, embedder_address) as stub:
        hits = await vector_hits(stub, embedder, "a stamp collection", k=2)
        assert [h.memory.id for h in hits] == [stamps.id, boat.id]
        await stub.Flush(store_pb2.FlushRequest())
    rebuilt = read_index_file(path)
    assert rebuilt is not None and rebuilt.dtype == ScalarKind.I8


@pytest.mark.usefixtures("usearch_indexes")
async def test_an_index_behind_sqlite_is_caught_up_at_start(
    tmp_path: Path, embedder_address: str, embedder: EmbedderClient
) -> None:
    async with serving_store(tmp_path, embedder_address, save_every_s=None) as stub:
        (old,) = await apply(stub, insert("Frank owns a sailboat"))
        await vector_hits(stub, embedder, "boat")
        await stub.Flush(store_pb2.FlushRequest())
        saved = {p: p.read_bytes() for p in (tmp_path / "vectors").glob("*.usearch")}
        (new,) = await apply(stub, insert("Frank grows tomatoes"))
        await apply(stub, store_pb2.Op(delete=store_pb2.DeleteOp(id=old.id)))
    for path, data in saved.items():
        path.write_bytes(data)  # as if the process died before saving again
    async with serving_store(tmp_path, embedder_address) as stub:
        hits = await vector_hits(stub, embedder, "boat or garden", k=5)
        assert [h.memory.id for h in hits] == [new.id]


@pytest.mark.sqlite_only
async def test_flush_folds_the_write_ahead_log_into_the_database(
    tmp_path: Path, embedder_address: str
) -> None:
    async with serving_store(tmp_path, embedder_address) as stub:
        await apply(stub, *(insert(f"note number {n} about gardening") for n in range(20)))
        wal = tmp_path / "hyatlas.db-wal"
        assert wal.stat().st_size > 0
        await stub.Flush(store_pb2.FlushRequest())
        assert wal.stat().st_size == 0
        assert len(await listed(stub)) == 20


@pytest.mark.sqlite_only
@pytest.mark.usefixtures("usearch_indexes")
async def test_indexes_past_the_budget_are_saved_dropped_and_caught_up_again(
    tmp_path: Path, embedder_address: str, embedder: EmbedderClient
) -> None:
    # A budget of one byte keeps one index loaded: each load evicts the one before.
    async with serving_store(
        tmp_path, embedder_address, save_every_s=None, index_cache_bytes=1
    ) as stub:
        (boat,) = await apply(stub, insert("Grace sails a small boat", user="grace"), user="grace")
        assert [h.memory.id for h in await vector_hits(stub, embedder, "boat", user="grace")] == [
            boat.id
        ]
        (hen,) = await apply(stub, insert("Hugo keeps hens", user="hugo"), user="hugo")
        assert [h.memory.id for h in await vector_hits(stub, embedder, "hens", user="hugo")] == [
            hen.id
        ]
        # Grace's index was saved when Hugo's pushed it out; her next write loads it again
        # (from its file), which saves and drops Hugo's.
        assert len(list((tmp_path / "vectors").glob("*.usearch"))) == 1
        (kayak,) = await apply(stub, insert("Grace bought a kayak", user="grace"), user="grace")
        hits = await vector_hits(stub, embedder, "boats and kayaks", user="grace", k=5)
        assert {h.memory.id for h in hits} == {boat.id, kayak.id}
        assert len(list((tmp_path / "vectors").glob("*.usearch"))) == 2


EVERYONE = common_pb2.Scope(all_users=True)


@pytest.mark.sqlite_only
async def test_a_store_built_with_a_model_the_embedder_cannot_run_is_re_embedded_first(
    tmp_path: Path, embedder_address: str, embedder: EmbedderClient
) -> None:
    async with serving_store(tmp_path, embedder_address) as stub:
        await apply(stub, insert("Ines speaks Italian"))
    with sqlite3.connect(tmp_path / "hyatlas.db") as db:
        db.execute("UPDATE vectors SET model_id = 'old-model'")
        db.execute("UPDATE store_meta SET value = 'old-model' WHERE key = 'model_id'")
    db.close()
    _, model_id = await embedder.embed(["x"])
    # Paced to a row a minute: the re-embed cannot be done while this store runs.
    slow = ReembedPlan(batch=1, rows_per_s=1 / 60)
    async with serving_store(tmp_path, embedder_address, reembed=slow) as stub:
        with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as info:
            await vector_hits(stub, embedder, "languages")
        details = info.value.details() or ""
        assert "old-model" in details and model_id in details
        assert await listed(stub) == ["Ines speaks Italian"]
        stats = await stub.GetStats(store_pb2.GetStatsRequest(scope=EVERYONE))
        assert stats.model_id == "old-model" and stats.reembed.to_model_id == model_id
    async with serving_store(tmp_path, embedder_address) as stub:

        async def re_embedded() -> None:
            stats = await stub.GetStats(store_pb2.GetStatsRequest(scope=EVERYONE))
            assert stats.model_id == model_id and not stats.HasField("reembed")

        await assert_eventually(re_embedded)
        (hit,) = await vector_hits(stub, embedder, "which language does Ines speak", k=1)
        assert hit.memory.content == "Ines speaks Italian" and hit.memory.model_id == model_id


async def test_acknowledged_writes_survive_kill_9(
    tmp_path: Path, embedder_address: str, embedder: EmbedderClient
) -> None:
    texts = [f"durable memory number {i} about topic {i * 7}" for i in range(6)]
    with running_stack(tmp_path, ["store"], HYATLAS_EMBEDDER_ADDR=embedder_address) as stack:
        async with open_channel(stack.address("store")) as channel:
            stub = store_pb2_grpc.StoreStub(channel)
            ids = []
            for text in texts:
                (row,) = await apply(stub, insert(text))
                ids.append(row.id)
        stack.procs["store"].kill()
        stack.start("store")
        async with open_channel(stack.address("store")) as channel:
            stub = store_pb2_grpc.StoreStub(channel)
            assert set(await listed(stub, limit=100)) == set(texts)
            for memory_id, text in zip(ids, texts, strict=True):
                hits = await vector_hits(stub, embedder, text, k=1)
                assert [h.memory.id for h in hits] == [memory_id]



@pytest.mark.sqlite_only  # on PostgreSQL the data is the database's, and replicas may share it
async def test_a_second_store_on_a_data_folder_exits_at_once_and_the_first_keeps_serving(
    tmp_path: Path, embedder_address: str
) -> None:
    with running_stack(tmp_path, ["store"], HYATLAS_EMBEDDER_ADDR=embedder_address) as stack:
        async with open_channel(stack.address("store")) as channel:
            stub = store_pb2_grpc.StoreStub(channel)
            await apply(stub, insert("written before the second store"))
            second = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "services.store"], cwd=ROOT,
                env=stack.env, capture_output=True, text=True, timeout=WAIT_CEILING_S,
            )
            assert second.returncode != 0
            assert f"another store holds the data folder {tmp_path}" in second.stderr
            await apply(stub, insert("written after it"))
            assert set(await listed(stub)) == {
                "written before the second store", "written after it"
            }

# --- the contract: batch reads, pages, counts ----------------------------------------------


async def test_get_memories_answers_in_order_and_lists_missing_or_foreign_ids(
    store: store_pb2_grpc.StoreStub,
) -> None:
    first, second = await apply(store, insert("first fact"), insert("second fact"))
    (foreign,) = await apply(store, insert("bob's fact", user="bob"), user="bob")
    reply = await store.GetMemories(store_pb2.GetMemoriesRequest(
        scope=scope(), ids=[second.id, "no-such-id", first.id, foreign.id, second.id]))
    assert [m.content for m in reply.memories] == ["second fact", "first fact"]
    # Another owner's id is reported exactly like one that does not exist.
    assert list(reply.missing) == ["no-such-id", foreign.id]


async def test_a_limit_over_the_maximum_is_refused_never_cut(
    store: store_pb2_grpc.StoreStub,
) -> None:
    for call in (
        store.ListMemories(store_pb2.ListMemoriesRequest(scope=scope(), limit=1001)),
        store.ListEdges(store_pb2.ListEdgesRequest(scope=scope(), limit=1001)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "over the maximum of 1000" in (caught.value.details() or "")


async def test_edges_page_with_offset_and_total(store: store_pb2_grpc.StoreStub) -> None:
    raws = await apply(store, *(insert(f"turn {n}", layer=L2) for n in range(2)))
    owner = common_pb2.Owner(user_id="alice")
    await apply(store, *(
        store_pb2.Op(put_edge=store_pb2.PutEdgeOp(
            owner=owner, subject=f"s{n}", relation="r", object=f"o{n}",
            source_ids=[r.id for r in raws]))
        for n in range(5)
    ))
    pages = [
        await store.ListEdges(store_pb2.ListEdgesRequest(scope=scope(), limit=2, offset=offset))
        for offset in (0, 2, 4)
    ]
    assert [p.total for p in pages] == [5, 5, 5]
    subjects = [e.subject for p in pages for e in p.edges]
    assert subjects == ["s4", "s3", "s2", "s1", "s0"]


async def test_edge_names_that_differ_only_in_case_name_one_entity_in_any_script(
    store: store_pb2_grpc.StoreStub,
) -> None:
    raws = await apply(store, *(insert(f"turn {n}", layer=L2) for n in range(3)))

    def put(subject: str, relation: str, obj: str, turns: list[common_pb2.Memory]) -> Any:
        return store_pb2.Op(put_edge=store_pb2.PutEdgeOp(
            owner=common_pb2.Owner(user_id="alice"), subject=subject, relation=relation,
            object=obj, source_ids=[t.id for t in turns]))

    await apply(store, put("Émile", "lives in", "Évora", raws[:2]))
    # The same triple in other cases: more evidence for that edge (one turn would not do for
    # a new one), not a second edge.
    await apply(store, put("émile", "LIVES IN", "ÉVORA", raws[2:]))
    await apply(store, put("ÉMILE", "knows", "Ødegaard", raws[:2]))
    reply = await store.ListEdges(store_pb2.ListEdgesRequest(scope=scope()))
    assert [(e.subject, e.relation, e.object, len(e.source_ids)) for e in reply.edges] == [
        ("ÉMILE", "knows", "Ødegaard", 2),
        ("Émile", "lives in", "Évora", 3),
    ]
    stats = await store.GetStats(store_pb2.GetStatsRequest(scope=scope()))
    assert (stats.graph_nodes, stats.graph_edges) == (3, 2)


async def test_count_memories_counts_rows_per_time_bucket(
    store: store_pb2_grpc.StoreStub,
) -> None:
    rows = await apply(store, insert("a raw turn", layer=L2), insert("a fact"), insert("another"))
    created = min(r.created_at for r in rows)
    start = created - 100.0

    async def counts(**kw: Any) -> list[int]:
        reply = await store.CountMemories(store_pb2.CountMemoriesRequest(
            scope=scope(), start=start, bucket_s=100.0, buckets=3, **kw))
        return list(reply.counts)

    assert await counts() == [0, 3, 0]
    assert await counts(layers=[L2]) == [0, 1, 0]
    assert await counts(exclude_layers=[L2]) == [0, 2, 0]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await store.CountMemories(store_pb2.CountMemoriesRequest(scope=scope(), buckets=0))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for length in (math.inf, math.nan, -1.0):  # one bucket of all time is no bucket
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT):
            await store.CountMemories(store_pb2.CountMemoriesRequest(
                scope=scope(), start=start, bucket_s=length, buckets=2))


async def test_list_by_superseded_by_finds_what_a_row_replaced(
    store: store_pb2_grpc.StoreStub,
) -> None:
    old, new, other = await apply(
        store, insert("lives in Leeds"), insert("lives in Bristol"), insert("likes tea"))
    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(
        id=old.id, superseded_how="replaced", superseded_by=new.id)))
    replaced = await listed(store, include_superseded=True, superseded_by=new.id)
    assert replaced == ["lives in Leeds"]
    assert await listed(store, include_superseded=True, superseded_by=other.id) == []


async def test_list_by_superseded_by_leaves_out_an_old_version_forgotten_since(
    store: store_pb2_grpc.StoreStub,
) -> None:
    old, new = await apply(store, insert("lives in Leeds"), insert("lives in Bristol"))
    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(
        id=old.id, superseded_how="replaced", superseded_by=new.id)))
    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=old.id))
    assert await listed(store, include_superseded=True, superseded_by=new.id) == []
    assert "lives in Leeds" in await listed(store, include_superseded=True)


async def test_list_by_source_id_finds_the_rows_learnt_from_a_turn_live_or_retired(
    store: store_pb2_grpc.StoreStub,
) -> None:
    turn, other = await apply(
        store, insert("m-src I moved to Bristol", layer=L2), insert("m-src2 hi", layer=L2))
    kept, retired, _ = await apply(
        store,
        insert("moved to Bristol", source_ids=[turn.id]),
        insert("lived in Leeds", source_ids=[other.id, turn.id]),
        insert("says hi", source_ids=[other.id]),
    )
    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(
        id=retired.id, superseded_how="replaced", superseded_by=kept.id)))
    assert await listed(store, include_superseded=True, source_id=turn.id, order="oldest") == [
        "moved to Bristol", "lived in Leeds"]
    assert await listed(store, source_id=turn.id) == ["moved to Bristol"]


async def test_list_by_contains_finds_the_rows_holding_a_text_in_any_case(
    store: store_pb2_grpc.StoreStub,
) -> None:
    rows = await apply(
        store,
        insert("Die ÖLFARBE trocknet langsam"),
        insert("ölfarbe kaufen"),
        insert("Acrylfarbe trocknet schnell"),
        insert("100% sure about the_plan"),
    )
    await apply(store, insert("ölfarbe for bob", user="bob"), user="bob")
    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=rows[1].id))
    assert await listed(store, contains="Ölfarbe") == ["Die ÖLFARBE trocknet langsam"]
    assert await listed(store, contains="ölFARBE", include_superseded=True, order="oldest") == [
        "Die ÖLFARBE trocknet langsam", "ölfarbe kaufen"]
    # LIKE's wildcards are plain characters here.
    assert await listed(store, contains="0% sure") == ["100% sure about the_plan"]
    assert await listed(store, contains="the_p") == ["100% sure about the_plan"]
    assert await listed(store, contains="e%p") == []
    page = await store.ListMemories(store_pb2.ListMemoriesRequest(
        scope=scope(), contains="trocknet", limit=1))
    assert page.total == 2 and len(page.memories) == 1
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await listed(store, contains="x" * 257)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


OLD_ADDRESS = "My home address is 12 Elm Street, Springfield."


async def an_old_version(stub: store_pb2_grpc.StoreStub) -> tuple[str, str, str]:
    """A turn, the fact learnt from it, and the newer version that replaced the fact: ids."""
    (turn,) = await apply(stub, insert("We moved in to 12 Elm Street in 2019", layer=L2))
    (old,) = await apply(stub, insert(OLD_ADDRESS, source_ids=[turn.id]))
    new, _ = await apply(
        stub,
        insert("My home address is 40 Oak Avenue, Shelbyville.", ref="new"),
        store_pb2.Op(retire=store_pb2.RetireOp(
            id=old.id, superseded_how="replaced", superseded_by="$new")),
    )
    return turn.id, old.id, new.id


async def test_forget_by_id_of_an_old_version_marks_it_forgotten_and_hides_it_from_the_new(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    turn, old, new = await an_old_version(store)
    reply = await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=old, reason="moved"))
    assert [m.id for m in reply.memories] == [old] and list(reply.evidence_ids) == [turn]
    got = (await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=old))).memory
    assert (got.status, got.superseded_how, got.superseded_by, got.drop_reason) == (
        "retired", "forgotten", new, "moved")
    evidence = (await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=turn))).memory
    assert tombstones(evidence.metadata_json) == [value_key(OLD_ADDRESS)]
    history = await store.GetHistory(store_pb2.GetHistoryRequest(scope=scope(), id=old))
    last = history.entries[-1]
    assert (last.action, json.loads(last.after_json)["superseded_how"]) == ("retire", "forgotten")
    near = await vector_hits(store, embedder, "home address", layers=[L3])
    assert [(h.memory.id, list(h.replaced)) for h in near] == [(new, [])]
    query = store_pb2.KeywordSearchRequest(scope=scope(), query="home address")
    found = (await store.KeywordSearch(query)).hits
    assert [(h.hit.memory.id, list(h.hit.replaced)) for h in found] == [(new, [])]
    again = await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=old))
    assert list(again.memories) == []

    # A restore reverses the forget only: an old version again, under the live new one.
    (back,) = await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=old)))
    assert (back.status, back.superseded_how, back.superseded_by, back.drop_reason) == (
        "retired", "replaced", new, "")
    evidence = (await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=turn))).memory
    assert tombstones(evidence.metadata_json) == []
    assert await listed(store, layers=[L3]) == ["My home address is 40 Oak Avenue, Shelbyville."]
    near = await vector_hits(store, embedder, "home address", layers=[L3])
    assert [(h.memory.id, [r.id for r in h.replaced]) for h in near] == [(new, [old])]


async def test_forget_by_text_counts_an_old_version_and_leaves_other_retired_rows_be(
    store: store_pb2_grpc.StoreStub,
) -> None:
    _, old, new = await an_old_version(store)
    (dropped,) = await apply(store, insert(OLD_ADDRESS))
    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(
        id=dropped.id, superseded_how="dropped", drop_reason="small talk")))

    reply = await store.Forget(store_pb2.ForgetRequest(scope=scope(), text=OLD_ADDRESS))
    assert [(m.id, m.superseded_how, m.superseded_by) for m in reply.memories] == [
        (old, "forgotten", new)]
    kept = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=dropped.id))
    assert kept.memory.superseded_how == "dropped"
    assert await listed(store, layers=[L3]) == ["My home address is 40 Oak Avenue, Shelbyville."]


async def test_a_forget_guards_the_newest_turns_still_to_be_extracted_and_older_ones_saying_it(
    store: store_pb2_grpc.StoreStub,
) -> None:
    """Turns still to be extracted are guarded against an extraction writing the value back:
    the newest GUARDED_TURNS (one in flight is most often of a turn just written), and an older
    one of a long backlog (no LLM, a key awaited) only when it says the value, in its words or
    near them in meaning: guarding thousands would make one forget that many row changes."""
    user = "gus"
    older = [
        "I told Gus the locker code is 4455 so he can get in",
        "The forecast says rain all weekend in Lisbon",
        "My combination for the gym locker, 4455, is the one Gus uses",
        "We watched a film about penguins last night",
        "Gus's locker opens with the digits four, four, five, five",
    ]
    turns = []
    texts = older + [f"gus turn {i}" for i in range(forget_module.GUARDED_TURNS)]
    for text in texts:
        pending = insert(text, user=user, layer=L2, extraction_status="pending")
        turns += [m.id for m in await apply(store, pending, user=user)]
    await apply(store, insert("Gus's locker code is 4455", user=user), user=user)

    await store.Forget(store_pb2.ForgetRequest(scope=scope(user), text="Gus's locker code is 4455"))
    marked = []
    for turn_id in turns:
        got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(user), id=turn_id))
        marked.append(tombstones(got.memory.metadata_json) != [])
    assert marked == [True, False, True, False, True] + [True] * forget_module.GUARDED_TURNS


async def test_a_guard_on_a_turn_to_be_extracted_takes_nothing_down_and_a_restore_lifts_it(
    store: store_pb2_grpc.StoreStub,
) -> None:
    """A turn still to be extracted is guarded against the value, not known to hold it: an
    episode resting on it stays live, and the value's restore takes the guard off."""
    user = "gus"
    (turn,) = await apply(store, insert("Gus: off to the gym", user=user, layer=L2,
                                        extraction_status="pending"), user=user)
    (fact,) = await apply(store, insert("Gus's locker code is 4455", user=user), user=user)
    (episode,) = await apply(store, insert("EPISODE: Gus went to the gym", user=user,
                                           layer=common_pb2.L4_SUMMARY, label="episode",
                                           source_ids=[turn.id]), user=user)

    await store.Forget(store_pb2.ForgetRequest(scope=scope(user), id=fact.id))
    guarded = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(user), id=turn.id))
    assert tombstones(guarded.memory.metadata_json) == [value_key(fact.content)]
    assert held_tombstones(guarded.memory.metadata_json) == []
    kept = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(user), id=episode.id))
    assert (kept.memory.status, kept.memory.superseded_how) == ("active", "")

    await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=fact.id)), user=user)
    lifted = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(user), id=turn.id))
    assert tombstones(lifted.memory.metadata_json) == []


# --- summaries (L4) of what a forget or delete takes ----------------------------------------

L4 = common_pb2.L4_SUMMARY


async def summaries(stub: store_pb2_grpc.StoreStub) -> list[tuple[str, str, str]]:
    """(label, status, superseded_how) of every L4 row of alice, oldest first."""
    reply = await stub.ListMemories(store_pb2.ListMemoriesRequest(
        scope=scope(), layers=[L4], include_superseded=True, order="oldest"))
    return [(m.label, m.status, m.superseded_how) for m in reply.memories]


async def summed_up_secret(stub: store_pb2_grpc.StoreStub) -> tuple[str, str, str]:
    """A turn, the fact learnt from it and an intention, summed up in a Now page (the fact and
    the intention) and an episode (the turn): the ids of the turn, fact and intention."""
    (turn,) = await apply(stub, insert("Hank: my safe combination is 31-22-17", layer=L2))
    fact, plan = await apply(
        stub,
        insert("Hank's safe combination is 31-22-17", source_ids=[turn.id]),
        insert("Hank will change the safe combination", layer=L7),
    )
    await apply(
        stub,
        insert("Now: Hank's safe opens with 31-22-17", layer=L4, label="now_page",
               source_ids=[fact.id, plan.id]),
        insert("EPISODE: Hank told his safe combination, 31-22-17", layer=L4, label="episode",
               source_ids=[turn.id]),
    )
    return turn.id, fact.id, plan.id


def restore(memory_id: str) -> store_pb2.Op:
    return store_pb2.Op(restore=store_pb2.RestoreOp(id=memory_id))


def delete(memory_id: str) -> store_pb2.Op:
    return store_pb2.Op(delete=store_pb2.DeleteOp(id=memory_id))


async def test_a_forget_retires_the_summaries_holding_the_value_and_its_restore_brings_them_back(
    store: store_pb2_grpc.StoreStub,
) -> None:
    turn, fact, plan = await summed_up_secret(store)
    # Done is no forget: the Now page is only out of date, and stays until it is rebuilt.
    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(id=plan, superseded_how="done")))
    assert await summaries(store) == [("now_page", "active", ""), ("episode", "active", "")]

    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=fact))
    # Retired in the forget's transaction: the page (the fact) and the episode (its turn, now
    # holding the value's tombstone).
    assert await summaries(store) == [("now_page", "retired", "stale"),
                                      ("episode", "retired", "stale")]
    page = (await store.ListMemories(store_pb2.ListMemoriesRequest(
        scope=scope(), layers=[L4], include_superseded=True, order="oldest"))).memories[0]
    assert page.drop_reason == f"evidence {fact} was forgotten"
    assert await listed(store, layers=[L4]) == []

    await apply(store, restore(fact))
    assert await summaries(store) == [("now_page", "active", ""), ("episode", "active", "")]
    held = (await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=turn))).memory
    assert tombstones(held.metadata_json) == []


async def test_a_delete_retires_the_summaries_of_the_row_and_a_newer_now_page_stands_alone(
    store: store_pb2_grpc.StoreStub,
) -> None:
    turn, fact, plan = await summed_up_secret(store)
    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=fact))
    await apply(store, insert("Now: Hank plans a new combination", layer=L4, label="now_page",
                              source_ids=[plan]))
    await apply(store, restore(fact))
    # One Now page is live at a time: the one built since the forget, not the older one back.
    assert await summaries(store) == [
        ("now_page", "retired", "stale"), ("episode", "active", ""), ("now_page", "active", "")]

    await apply(store, delete(turn))
    await apply(store, delete(plan))
    assert await summaries(store) == [
        ("now_page", "retired", "stale"), ("episode", "retired", "stale"),
        ("now_page", "retired", "stale")]



async def test_a_delete_of_a_whole_layer_takes_down_what_rests_on_its_rows_as_one_delete_does(
    store: store_pb2_grpc.StoreStub,
) -> None:
    """A bulk delete (DELETE /api/v1/delete_all with a layer) erases thousands of rows in one
    write: the summaries, the profile mirror and the edges resting on them go with them."""
    await summed_up_secret(store)
    await apply(store, insert("Prefers tea over coffee", label="user_preferences"))
    (kept,) = await apply(store, insert("Hank works in Leeds"))
    await apply(store, insert("Now: Hank works in Leeds", layer=L4, label="now_page",
                              source_ids=[kept.id]))
    assert [m.content for m in await profile_rows(store)] == ["Prefers tea over coffee"]

    await store.DeleteMemories(store_pb2.DeleteMemoriesRequest(scope=scope(), layers=[L3]))
    # The Now page and the profile rested on facts; the episode rests on a turn, still there.
    assert await summaries(store) == [("now_page", "retired", "stale"), ("episode", "active", ""),
                                      ("now_page", "retired", "stale")]
    assert await profile_rows(store) == []


async def profile_rows(stub: store_pb2_grpc.StoreStub) -> list[common_pb2.Memory]:
    """alice's live L1 rows."""
    reply = await stub.ListMemories(store_pb2.ListMemoriesRequest(
        scope=scope(), layers=[common_pb2.L1_PROFILE]))
    return list(reply.memories)

async def test_a_summary_written_after_its_evidence_was_forgotten_is_retired_as_it_is_written(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (fact,) = await apply(store, insert("Hank's safe combination is 31-22-17"))
    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=fact.id))
    # A Now page whose rebuild read the fact before the forget, written after it.
    (page,) = await apply(store, insert("Now: Hank's safe opens with 31-22-17", layer=L4,
                                        label="now_page", source_ids=[fact.id]))
    assert (page.status, page.superseded_how) == ("retired", "stale")
    assert await listed(store, layers=[L4]) == []
    await apply(store, restore(fact.id))
    assert await summaries(store) == [("now_page", "active", "")]


async def test_a_forgotten_episode_is_restored_and_its_value_leaves_its_turn(
    store: store_pb2_grpc.StoreStub,
) -> None:
    turn, _, _ = await summed_up_secret(store)
    episode = (await store.ListMemories(store_pb2.ListMemoriesRequest(
        scope=scope(), layers=[L4], order="oldest"))).memories[1]
    reply = await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=episode.id))
    assert [m.id for m in reply.memories] == [episode.id]
    # The turn's tombstone holds the episode's own value: the restore lifts it, so it does not
    # keep the episode down.
    (back,) = await apply(store, restore(episode.id))
    assert back.status == "active"
    held = (await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=turn))).memory
    assert tombstones(held.metadata_json) == []


async def test_an_old_now_page_is_not_restored_while_a_newer_one_is_live(
    store: store_pb2_grpc.StoreStub,
) -> None:
    _, fact, plan = await summed_up_secret(store)
    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=fact))
    await apply(store, insert("Now: Hank plans a new combination", layer=L4, label="now_page",
                              source_ids=[plan]))
    await apply(store, restore(fact))
    old = (await store.ListMemories(store_pb2.ListMemoriesRequest(
        scope=scope(), layers=[L4], include_superseded=True, order="oldest"))).memories[0]
    with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as caught:
        await apply(store, restore(old.id))
    assert "another Now page is live" in (caught.value.details() or "")
    assert await summaries(store) == [
        ("now_page", "retired", "stale"), ("episode", "active", ""), ("now_page", "active", "")]


async def test_an_old_arc_does_not_come_back_beside_a_newer_one(
    store: store_pb2_grpc.StoreStub,
) -> None:
    """The consolidator keeps one arc an owner: one gone stale with its evidence stays down
    when the evidence comes back after a newer arc was built, and cannot be restored."""
    fact, other = await apply(store, insert("Hank's safe combination is 31-22-17"),
                              insert("Hank works in Leeds"))
    (old,) = await apply(store, insert("Arc: Hank guards his safe", layer=L4, label="arc",
                                       source_ids=[fact.id]))
    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=fact.id))
    await apply(store, insert("Arc: Hank settles in Leeds", layer=L4, label="arc",
                              source_ids=[other.id]))
    await apply(store, restore(fact.id))
    assert await summaries(store) == [("arc", "retired", "stale"), ("arc", "active", "")]
    with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as caught:
        await apply(store, restore(old.id))
    assert "another arc is live" in (caught.value.details() or "")


# --- entity pages (L8) a restore brings back ---------------------------------------------------

L8 = common_pb2.L8_ENTITY


def page(name: str, state: str, facts: list[str], rests_on: list[str],
         history: tuple[dict[str, Any], ...] = ()) -> store_pb2.Op:
    """An entity page as the extractor writes it: its text and its lines in its metadata."""
    meta = {"entity": name, "kind": "", "state": state, "history": list(history),
            "facts": facts, "rests_on": rests_on}
    text = "\n".join([f"{name}: {state}", *(["History:"] if history else []),
                      *(f"- {h['date']}: {h['state']}" for h in history)])
    return insert(text, layer=L8, label="entity", metadata_json=json.dumps(meta))


async def test_a_page_whose_every_line_is_stale_is_not_restored_and_its_values_stay_forgotten(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (turn,) = await apply(store, insert("kq-bravo Golf uses Redis 7; Carol likes coffee.",
                                        layer=L2))
    fact, _ = await apply(store, insert("Golf uses Redis 7", source_ids=[turn.id]),
                          insert("Carol likes coffee", source_ids=[turn.id]))
    (golf,) = await apply(store, page("Golf", "Golf uses Redis 7", [fact.id],
                                      [turn.id, fact.id]))
    await apply(store, insert("EPISODE: a chat about the stack and a drink", layer=L4,
                              label="episode", source_ids=[turn.id]))
    reply = await store.Forget(store_pb2.ForgetRequest(scope=scope(), text="Golf uses Redis 7"))
    assert {m.id for m in reply.memories} == {fact.id, golf.id}

    with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as caught:
        await apply(store, restore(golf.id))
    assert "no line of the page is live" in (caught.value.details() or "")
    got = (await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=golf.id))).memory
    assert (got.status, got.superseded_how) == ("retired", "forgotten")
    held = (await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=turn.id))).memory
    assert "golf uses redis 7" in tombstones(held.metadata_json)
    assert await summaries(store) == [("episode", "retired", "stale")]


async def test_a_restored_page_lifts_the_values_of_its_live_lines_only(
    store: store_pb2_grpc.StoreStub,
) -> None:
    old_turn, new_turn = await apply(
        store, insert("kq-golf1 Golf runs on Redis 7 for now.", layer=L2),
        insert("kq-golf2 Golf moved over to Postgres 16.", layer=L2))
    old, new = await apply(store, insert("Golf runs on Redis 7", source_ids=[old_turn.id]),
                           insert("Golf moved to Postgres 16", source_ids=[new_turn.id]))
    was = {"date": "2026-12-01", "state": "runs on Redis 7", "facts": [old.id],
           "rests_on": [old_turn.id, old.id]}
    (golf,) = await apply(store, page("Golf", "moved to Postgres 16", [new.id],
                                      [new_turn.id, new.id], (was,)))
    reply = await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=old.id))
    assert {m.id for m in reply.memories} == {old.id, golf.id}

    (back,) = await apply(store, restore(golf.id))
    assert (back.status, back.content) == ("active", "Golf: moved to Postgres 16")
    # The line of the fact still forgotten stays stale, and its value stays on its turn.
    held = (await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=old_turn.id)))
    assert "golf runs on redis 7" in tombstones(held.memory.metadata_json)


async def test_an_old_page_is_not_restored_while_a_newer_page_of_its_entity_is_live(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (beta,) = await apply(store, page("India", "in beta", [], []))
    reply = await store.Forget(store_pb2.ForgetRequest(scope=scope(), text="India: in beta"))
    assert [m.id for m in reply.memories] == [beta.id]
    (launched,) = await apply(store, page("India", "launched", [], []))

    with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as caught:
        await apply(store, restore(beta.id))
    assert f"page {launched.id!r} of its entity is live" in (caught.value.details() or "")
    assert await listed(store, layers=[L8]) == ["India: launched"]


# --- the L1 profile mirror of preference facts, kept by the store ----------------------------

L1 = common_pb2.L1_PROFILE


async def profile(stub: store_pb2_grpc.StoreStub) -> list[tuple[str, str, str]]:
    """(content, status, superseded_how) of every L1 row of alice, oldest first."""
    reply = await stub.ListMemories(store_pb2.ListMemoriesRequest(
        scope=scope(), layers=[L1], include_superseded=True, order="oldest"))
    return [(m.content, m.status, m.superseded_how) for m in reply.memories]


async def test_a_mirror_is_not_restored_alone_while_its_fact_is_forgotten(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (tea,) = await apply(store, insert("Prefers tea over coffee", label="user_preferences"))
    await store.Forget(store_pb2.ForgetRequest(scope=scope(), id=tea.id))
    (mirror,) = (await store.ListMemories(store_pb2.ListMemoriesRequest(
        scope=scope(), layers=[L1], include_superseded=True))).memories
    with raises_code(grpc.StatusCode.FAILED_PRECONDITION) as caught:
        await apply(store, restore(mirror.id))
    assert f"preference fact {tea.id!r}, which is forgotten" in (caught.value.details() or "")
    assert await profile(store) == [("Prefers tea over coffee", "retired", "forgotten")]

    await apply(store, restore(tea.id))
    assert await profile(store) == [("Prefers tea over coffee", "active", "")]


async def test_a_preference_fact_is_mirrored_and_its_mirror_follows_it(
    store: store_pb2_grpc.StoreStub,
) -> None:
    (tea,) = await apply(store, insert("Prefers tea over coffee", label="user_preferences"))
    await apply(store, insert("Works in Leeds", label="user_info"))
    assert await profile(store) == [("Prefers tea over coffee", "active", "")]

    await apply(store, store_pb2.Op(retire=store_pb2.RetireOp(
        id=tea.id, superseded_how="forgotten", drop_reason="user asked")))
    assert await profile(store) == [("Prefers tea over coffee", "retired", "forgotten")]

    await apply(store, store_pb2.Op(restore=store_pb2.RestoreOp(id=tea.id)))
    assert await profile(store) == [("Prefers tea over coffee", "active", "")]

    # Restated by a fact of the same value in one change: one mirror, still live.
    again, _ = await apply(
        store,
        insert("prefers tea over coffee.", label="user_preferences", ref="again"),
        store_pb2.Op(retire=store_pb2.RetireOp(
            id=tea.id, superseded_how="restated", superseded_by="$again")),
    )
    assert await profile(store) == [("Prefers tea over coffee", "active", "")]

    await apply(store, store_pb2.Op(delete=store_pb2.DeleteOp(id=again.id)))
    # Erased with the last fact of its value: no copy of the text is left behind.
    assert await profile(store) == []


async def test_a_vector_that_comes_with_its_insert_is_stored_as_it_is_at_8_bits(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    vectors, model_id = await embedder.embed(["Keeps bees on the roof"])
    op = insert("Keeps bees on the roof")
    op.insert.vector.extend(vectors[0].tolist())
    op.insert.vector_model_id = model_id
    (row,) = await apply(store, op)
    got = await store.GetMemory(store_pb2.GetMemoryRequest(scope=scope(), id=row.id,
                                                           with_vector=True))
    assert got.memory.model_id == model_id
    # 8 bits a component, the largest being 127 steps: each within half a step, the direction
    # within a ten-thousandth.
    step = float(np.abs(vectors[0]).max()) / 127
    assert list(got.vector) == pytest.approx(vectors[0].tolist(), abs=step / 2 + 1e-6)
    cosine = np.dot(got.vector, vectors[0]) / np.linalg.norm(got.vector)
    assert float(cosine) == pytest.approx(1.0, abs=1e-4)

    wrong = insert("Keeps goats")
    wrong.insert.vector.extend(vectors[0].tolist())
    wrong.insert.vector_model_id = "another-model"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await apply(store, wrong)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "another-model" in (caught.value.details() or "")
    assert await listed(store) == ["Keeps bees on the roof"]


async def test_read_many_answers_independent_reads_in_order_and_searches_near_a_row(
    store: store_pb2_grpc.StoreStub,
) -> None:
    turn, tea, bikes = await apply(
        store, insert("I drink green tea every morning", layer=L2),
        insert("Drinks green tea in the morning"), insert("Repairs old road bikes"))
    reply = await store.ReadMany(store_pb2.ReadManyRequest(reads=[
        store_pb2.Read(get=store_pb2.GetMemoryRequest(scope=scope(), id=turn.id,
                                                      with_vector=True)),
        store_pb2.Read(vector_search=store_pb2.VectorSearchRequest(
            scope=scope(), near_id=turn.id, layers=[L3], k=1, min_score=0.3)),
        store_pb2.Read(list=store_pb2.ListMemoriesRequest(scope=scope(), layers=[L3])),
    ]))
    got, near, listed = reply.results
    assert got.get.memory.id == turn.id and len(got.get.vector) == 384
    assert [h.memory.id for h in near.vector_search.hits] == [tea.id]
    assert {m.id for m in listed.list.memories} == {tea.id, bikes.id}

    # One read that fails fails them all, with its own status.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await store.ReadMany(store_pb2.ReadManyRequest(reads=[
            store_pb2.Read(get=store_pb2.GetMemoryRequest(scope=scope(), id=turn.id)),
            store_pb2.Read(vector_search=store_pb2.VectorSearchRequest(
                scope=scope("bob"), near_id=turn.id, layers=[L3], k=1)),
        ]))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await store.ReadMany(store_pb2.ReadManyRequest(reads=[
            store_pb2.Read(get=store_pb2.GetMemoryRequest(scope=scope(), id=turn.id))] * 65))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_turn_found_by_search_names_the_turn_it_follows_in_its_sitting(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    # Written one at a time, as turns arrive: each follows the one before in its session.
    question, answer = [
        (await apply(store, insert(text, layer=L2, session="s1")))[0]
        for text in ("Where did you go on the road trip?", "We drove to Woodhaven in the Midwest.")
    ]
    elsewhere = (await apply(store, insert("Woodhaven has a lovely library.", layer=L2,
                                           session="s2")))[0]
    fact = (await apply(store, insert("Woodhaven is a small town.", session="s1")))[0]

    keyword = await store.KeywordSearch(
        store_pb2.KeywordSearchRequest(scope=scope(), query="Woodhaven road trip", min_terms=1)
    )
    follows = {h.hit.memory.id: h.hit.follows_id for h in keyword.hits}
    assert follows[answer.id] == question.id
    # The first turn of a sitting, a turn of another sitting and a fact follow nothing.
    assert follows[elsewhere.id] == "" and follows[fact.id] == ""
    assert follows[question.id] == ""
    vector = {h.memory.id: h.follows_id for h in await vector_hits(store, embedder, "Woodhaven")}
    assert vector[answer.id] == question.id


def _import_request(*texts: str, prefix: str = "imp", **fields: Any) -> store_pb2.ImportRowsRequest:
    lines = [
        store_pb2.ImportLine(line=i + 1, json=json.dumps({"type": "memory", "memory": {
            "id": f"{prefix}-{i}", "user_id": "alice", "content": text}}))
        for i, text in enumerate(texts)
    ]
    return store_pb2.ImportRowsRequest(scope=scope(), lines=lines, **fields)


async def test_an_import_told_a_line_is_held_that_no_row_holds_embeds_it_as_it_is_written(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    # Since 2026-12-08 EmbedImport leaves out the lines whose id is held, and ImportRows skips
    # them: told so of a line no row holds, it embeds the batch itself, each line its own.
    texts = ("Keeps bees in the garden", "Repairs old road bikes at home")
    ahead = await store.EmbedImport(_import_request(*texts, prefix="unheld"))
    assert (ahead.rows, list(ahead.held_lines)) == (2, [])
    second = np.frombuffer(ahead.vectors, dtype="<f4").reshape(2, 384)[1:].tobytes()
    reply = await store.ImportRows(_import_request(
        *texts, prefix="unheld", vectors=second, vectors_model_id=ahead.model_id, held_lines=[1]))
    assert (reply.imported, reply.skipped, list(reply.errors)) == (2, 0, [])
    (bees, bikes), _ = await embedder.embed(list(texts))
    assert float(np.dot(await _stored_vector(store, "unheld-0"), bees)) > 0.999
    assert float(np.dot(await _stored_vector(store, "unheld-1"), bikes)) > 0.999
    # Sent again, both are held: none embedded ahead, both skipped.
    again = await store.EmbedImport(_import_request(*texts, prefix="unheld"))
    assert (again.rows, list(again.held_lines)) == (0, [1, 2])
    reply = await store.ImportRows(_import_request(
        *texts, prefix="unheld", vectors_model_id=again.model_id, held_lines=again.held_lines))
    assert (reply.imported, reply.skipped) == (0, 2)


async def test_an_import_whose_states_for_raw_lines_are_unknown_is_refused_and_writes_nothing(
    store: store_pb2_grpc.StoreStub,
) -> None:
    # The request's states fill in what a raw line leaves out: a line may not carry these.
    for fields, error in (
        ({"extraction_status": "bogus"}, "import: extraction_status 'bogus' is not one of"),
        ({"write_mode": "bogus"}, "import: write_mode 'bogus' is not one of lite, pro"),
    ):
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as caught:
            await store.ImportRows(_import_request("Keeps bees on the roof", **fields))
        assert error in (caught.value.details() or "")
    assert await listed(store) == []


async def _stored_vector(store: store_pb2_grpc.StoreStub, memory_id: str) -> np.ndarray:
    got = await store.GetMemory(
        store_pb2.GetMemoryRequest(scope=scope(), id=memory_id, with_vector=True))
    return np.array(got.vector, dtype=np.float32)


async def test_an_import_takes_the_vectors_embedded_ahead_for_its_lines_when_they_fit(
    store: store_pb2_grpc.StoreStub, embedder: EmbedderClient
) -> None:
    texts = ("Keeps bees on the roof", "Repairs old road bikes")
    ahead = await store.EmbedImport(_import_request(*texts))
    assert (ahead.rows, len(ahead.vectors)) == (2, 2 * 384 * 4)
    (bees, bikes), model_id = await embedder.embed(list(texts))
    assert ahead.model_id == model_id
    rows = np.frombuffer(ahead.vectors, dtype="<f4").reshape(2, 384)
    assert float(np.dot(rows[0], bees)) == pytest.approx(1.0, abs=1e-5)
    # Given in swapped order, they are taken as they are: the bikes' vector for the bees.
    swapped = rows[::-1].copy().tobytes()
    reply = await store.ImportRows(
        _import_request(*texts, vectors=swapped, vectors_model_id=ahead.model_id))
    assert (reply.imported, list(reply.errors)) == (2, [])
    assert float(np.dot(await _stored_vector(store, "imp-0"), bikes)) > 0.999
    # Vectors that do not fit (two for one line; another model's) are not used: the line is
    # embedded as it is written.
    (tomatoes,), _ = await embedder.embed(["Grows tomatoes on the balcony"])
    for prefix, fields in (
        ("two", {"vectors": rows.tobytes(), "vectors_model_id": ahead.model_id}),
        ("other", {"vectors": rows[:1].tobytes(), "vectors_model_id": "another-model"}),
    ):
        reply = await store.ImportRows(
            _import_request("Grows tomatoes on the balcony", prefix=prefix, **fields))
        assert reply.imported == 1
        stored = await _stored_vector(store, f"{prefix}-0")
        assert float(np.dot(stored, tomatoes)) > 0.999
    # Given at another length (a caller's own scaling), they are stored at unit length.
    for prefix, scale in (("ten", 10.0), ("huge", 1e20)):
        scaled = (rows[:1].astype(np.float64) * scale).astype("<f4").tobytes()
        reply = await store.ImportRows(_import_request(
            texts[0], prefix=prefix, vectors=scaled, vectors_model_id=ahead.model_id))
        assert reply.imported == 1
        stored = await _stored_vector(store, f"{prefix}-0")
        assert float(np.linalg.norm(stored)) == pytest.approx(1.0, abs=1e-3)
        assert float(np.dot(stored, bees)) > 0.999
    # A bad line: nothing embedded ahead; the import names the line and writes nothing.
    bad = _import_request("Fine line")
    bad.lines.append(store_pb2.ImportLine(line=9, json="{not json"))
    assert (await store.EmbedImport(bad)).rows == 0
    refused = await store.ImportRows(bad)
    assert [e.line for e in refused.errors] == [9] and refused.imported == 0
