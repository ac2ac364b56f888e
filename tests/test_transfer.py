"""Export and import over real HTTP: a store moved to a fresh data directory comes back whole."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from tests.support import Stack, running_stack

pytestmark = pytest.mark.slow

LAYERS = [
    "l1_profile",
    "l2_raw",
    "l3_fact",
    "l4_summary",
    "l5_knowledge",
    "l6_schema",
    "l7_intention",
    "l8_entity",
]
LONG_TEXT = (
    "We spent the whole of March renovating the old farmhouse near Evora. The roof had to be "
    "replaced before the spring rains arrived. My sister Ana painted every room a different "
    "shade of blue. The kitchen still needs a proper wood stove for the winter."
)
QUERIES = ["farmhouse roof", "favourite tea", "dentist appointment", "sister painted rooms"]


def _stack(tmp_path_factory: pytest.TempPathFactory, name: str, embedder: str) -> Any:
    return running_stack(
        tmp_path_factory.mktemp(name),
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder,
        HYATLAS_ADMIN="on",
    )


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    with _stack(tmp_path_factory, "transfer-source", embedder_address) as stack:
        yield stack


@pytest.fixture
def target(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    with _stack(tmp_path_factory, "transfer-target", embedder_address) as stack:
        yield stack


async def _call(stack: Stack, method: str, path: str, **kw: Any) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, stack.base_url + path, **kw) as reply,
    ):
        return reply.status, await reply.json()


async def _export(stack: Stack, **params: str) -> list[dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(stack.base_url + "/api/v1/export", params=params) as reply,
    ):
        assert reply.status == 200, await reply.text()
        assert reply.content_type == "application/x-ndjson"
        return [json.loads(line) for line in (await reply.text()).splitlines()]


async def _import(stack: Stack, lines: list[Any] | bytes, **params: str) -> tuple[int, Any]:
    body = lines if isinstance(lines, bytes) else "".join(json.dumps(x) + "\n" for x in lines)
    return await _call(stack, "POST", "/api/v1/import", data=body, params=params)


async def _apply(stack: Stack, user: str, *ops: store_pb2.Op) -> list[common_pb2.Memory]:
    async with open_channel(stack.address("store")) as channel:
        reply = await store_pb2_grpc.StoreStub(channel).Apply(
            store_pb2.ApplyRequest(
                scope=common_pb2.Scope(user_id=user), ops=list(ops), actor="api"
            ),
            timeout=60,
        )
    return list(reply.memories)


def _insert(user: str, layer: str, content: str, **fields: Any) -> store_pb2.Op:
    return store_pb2.Op(
        insert=store_pb2.NewMemory(
            owner=common_pb2.Owner(user_id=user, session_id="s1"),
            layer=LAYERS.index(layer) + 1,
            content=content,
            **fields,
        )
    )


async def _seed(stack: Stack, user: str) -> dict[str, str]:
    """Rows in all layers, turns with context and clause keys, retired/restored rows, an edge."""
    for text in ("I had a dentist appointment on Tuesday.", LONG_TEXT, "I drink green tea daily."):
        status, body = await _call(
            stack, "POST", "/api/v1/add", json={"text": text, "user_id": user, "session_id": "s1"}
        )
        assert status == 200, body
    rows = await _apply(
        stack,
        user,
        *(_insert(user, layer, f"{layer} note: my favourite tea is sencha") for layer in LAYERS),
        _insert(user, "l3_fact", "My favourite tea is oolong.", metadata_json='{"k": [1, 2]}'),
        _insert(user, "l7_intention", "Call the dentist again", due_at=1_900_000_000.0),
    )
    ids = {common_pb2.Layer.Name(row.layer).lower(): row.id for row in rows[:8]}
    old, again = rows[8].id, rows[9].id
    await _apply(
        stack,
        user,
        store_pb2.Op(
            retire=store_pb2.RetireOp(
                id=old, superseded_how="replaced", superseded_by=ids["l3_fact"], drop_reason="x"
            )
        ),
        store_pb2.Op(retire=store_pb2.RetireOp(id=again, superseded_how="done")),
    )
    await _apply(stack, user, store_pb2.Op(restore=store_pb2.RestoreOp(id=again)))
    status, listing = await _call(
        stack, "POST", "/api/v1/list", json={"user_id": user, "layer": "l2_raw"}
    )
    turns = [m["memory_id"] for m in listing["memories"]]
    await _apply(
        stack,
        user,
        store_pb2.Op(
            put_edge=store_pb2.PutEdgeOp(
                owner=common_pb2.Owner(user_id=user),
                subject="user",
                relation="drinks",
                object="sencha",
                source_ids=turns[:2],
                fact_ids=[ids["l3_fact"]],
                memory_id=ids["l5_knowledge"],
                valid_from=1_700_000_000.0,
            )
        ),
    )
    return {"retired": old, "restored": again, **ids}


async def _observed(stack: Stack, user: str) -> dict[str, Any]:
    """What a user sees: every row, each row's history, search hits and edges."""
    status, listing = await _call(
        stack,
        "POST",
        "/api/v1/list",
        json={"user_id": user, "limit": 1000, "include_superseded": True},
    )
    assert status == 200, listing
    history = {}
    for memory in listing["memories"]:
        status, body = await _call(
            stack, "GET", "/api/v1/history", params={"user_id": user, "id": memory["memory_id"]}
        )
        assert status == 200, body
        history[memory["memory_id"]] = [
            {k: v for k, v in entry.items() if k != "seq"} for entry in body["history"]
        ]
    hits = {}
    for query in QUERIES:
        status, body = await _call(
            stack, "POST", "/api/v1/search", json={"query": query, "user_id": user, "limit": 10}
        )
        assert status == 200, body
        hits[query] = {
            channel: [(m["memory_id"], round(m["score"], 4)) for m in items]
            for channel, items in body["memories"].items()
        }
    status, edges = await _call(stack, "GET", "/api/v1/edges", params={"user_id": user})
    assert status == 200, edges
    return {"list": listing, "history": history, "hits": hits, "edges": edges}


async def test_round_trip_to_a_fresh_data_dir_gives_the_same_store(
    source: Stack, target: Stack
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    ids = await _seed(source, user)
    exported = await _export(source)
    head, lines = exported[0], exported[1:]
    assert head["format"] == "hyatlas-export" and head["version"] == 1 and head["ndim"] == 384
    memories = [line for line in lines if line["type"] == "memory"]
    assert {m["memory"]["layer"] for m in memories} == set(LAYERS)
    assert [line["type"] for line in lines].count("edge") == 1
    restored = next(m for m in memories if m["memory"]["id"] == ids["restored"])
    assert [e["action"] for e in restored["history"]] == ["insert", "retire", "restore"]
    long_turn = next(m for m in memories if m["memory"]["content"] == LONG_TEXT)
    assert {k["kind"] for k in long_turn["keys"]} == {"clause", "context"}
    vector = np.frombuffer(base64.b64decode(long_turn["vector"]), dtype="<f4")
    assert vector.shape == (384,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-4

    status, reply = await _import(target, exported)
    assert status == 200, reply
    assert reply == {
        "lines": len(lines),
        "imported": len(lines),
        "skipped": 0,
        "refused": 0,
        "errors": [],
    }
    assert await _observed(target, user) == await _observed(source, user)
    again = await _export(target)
    assert again[1:] == lines  # every field, vector, key and audit entry, in the same order

    status, twice = await _import(target, exported)
    assert status == 200, twice
    assert (twice["imported"], twice["skipped"]) == (0, len(lines))
    assert (await _export(target))[1:] == lines


async def test_a_bad_line_is_refused_with_its_number_and_its_batch_is_not_applied(
    target: Stack,
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    good = {"type": "memory", "memory": {"user_id": user, "content": "The boat is blue."}}
    bad_layer = {"type": "memory", "memory": {"user_id": user, "content": "x", "layer": "l9"}}
    body = (
        json.dumps(good) + "\n\n" + json.dumps(bad_layer) + "\n{not json\n" + json.dumps(good)
    ).encode()
    status, reply = await _import(target, body)
    assert status == 400, reply
    assert [e["line"] for e in reply["errors"]] == [3, 4]
    assert "memory.layer 'l9'" in reply["errors"][0]["error"]
    assert reply["error"].startswith("line 3: ")
    assert (reply["lines"], reply["imported"], reply["refused"]) == (4, 0, 2)
    status, listing = await _call(target, "POST", "/api/v1/list", json={"user_id": user})
    assert listing["total"] == 0


async def test_a_header_of_another_format_is_refused_and_changes_nothing(target: Stack) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    line = {"type": "memory", "memory": {"user_id": user, "content": "Some text."}}
    status, reply = await _import(target, [{"format": "hyatlas-export", "version": 2}, line])
    assert status == 400 and reply["error"] == "export version 2 is not 1"
    status, listing = await _call(target, "POST", "/api/v1/list", json={"user_id": user})
    assert listing["total"] == 0


async def test_minimal_lines_are_embedded_keyed_and_searchable(target: Stack) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    turns = [
        "Where should we go hiking this weekend?",
        "The Serra da Estrela trails are beautiful in October.",
        "Then let's book the mountain cabin near Manteigas.",
    ]
    lines = [
        {
            "type": "memory",
            "memory": {
                "user_id": user,
                "session_id": "trip",
                "content": text,
                "created_at": 1_700_000_000 + i,
                "id": f"{user}-{i}",
            },
        }
        for i, text in enumerate(turns)
    ]
    lines.append({"type": "memory", "memory": {"user_id": user, "content": LONG_TEXT}})
    status, reply = await _import(target, lines)
    assert status == 200, reply
    assert (reply["imported"], reply["skipped"]) == (4, 0)

    status, body = await _call(
        target, "POST", "/api/v1/search", json={"query": "mountain cabin booking", "user_id": user}
    )
    hits = [m for items in body["memories"].values() for m in items]
    assert hits and hits[0]["memory_id"] == f"{user}-2"
    exported = await _export(target, user_id=user)
    by_content = {line["memory"]["content"]: line for line in exported[1:]}
    middle = by_content[turns[1]]
    assert middle["memory"]["created_at"] == 1_700_000_001
    assert middle["memory"]["layer"] == "l2_raw"
    assert middle["memory"]["extraction_status"] == "skipped"  # lite, as /add would set it
    assert turns[0] in middle["keys"][0]["text"] and turns[2] in middle["keys"][0]["text"]
    # Every key is what an ordinary write of the same turns builds.
    written = f"user-{uuid.uuid4().hex[:8]}"
    for text in turns:
        await _call(
            target,
            "POST",
            "/api/v1/add",
            json={"text": text, "user_id": written, "session_id": "trip"},
        )
    await _call(target, "POST", "/api/v1/add", json={"text": LONG_TEXT, "user_id": written})
    ordinary = {
        line["memory"]["content"]: line for line in (await _export(target, user_id=written))[1:]
    }
    assert {c: line["keys"] for c, line in by_content.items()} == {
        c: line["keys"] for c, line in ordinary.items()
    }
    assert [k["kind"] for k in by_content[LONG_TEXT]["keys"]].count("clause") == 4
    assert [(e["actor"], e["action"], e["reason"]) for e in middle["history"]] == [
        ("api", "insert", "import")
    ]


async def test_vectors_of_another_model_are_embedded_again(target: Stack) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    foreign = base64.b64encode(np.ones(8, dtype="<f4").tobytes()).decode()
    lines = [
        {"format": "hyatlas-export", "version": 1, "model_id": "other-model", "ndim": 8},
        {
            "type": "memory",
            "memory": {"user_id": user, "content": "The cat is called Miso.", "id": f"{user}-c"},
            "vector": foreign,
        },
    ]
    status, reply = await _import(target, lines)
    assert status == 200, reply
    status, body = await _call(
        target, "POST", "/api/v1/search", json={"query": "name of the cat", "user_id": user}
    )
    hits = [m for items in body["memories"].values() for m in items]
    assert [m["memory_id"] for m in hits] == [f"{user}-c"]


async def test_exporting_every_owner_needs_admin_and_one_owner_only_sees_its_rows(
    source: Stack, tmp_path: Path, embedder_address: str
) -> None:
    mine, other = f"user-{uuid.uuid4().hex[:8]}", f"user-{uuid.uuid4().hex[:8]}"
    for user in (mine, other):
        await _call(source, "POST", "/api/v1/add", json={"text": "hello there", "user_id": user})
    exported = await _export(source, user_id=mine)
    assert {line["memory"]["user_id"] for line in exported[1:]} == {mine}
    with running_stack(
        tmp_path, ["store", "gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address
    ) as plain:
        status, body = await _call(plain, "GET", "/api/v1/export")
        assert status == 403 and "HYATLAS_ADMIN=on" in body["error"]
