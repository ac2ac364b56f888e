"""A store's state as a user sees it over REST, and rows in every layer to fill one with."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from services.store.config import StoreConfig
from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from tests.support import Stack, StoreBackend

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


def store_config(data_dir: Path, embedder_address: str, **options: Any) -> StoreConfig:
    """An in-process store's settings: its socket and data in data_dir, on the module's
    backend."""
    return StoreConfig(
        data_dir=data_dir,
        address=f"unix:{data_dir / 'store.sock'}",
        embedder_address=embedder_address,
        store_dsn=StoreBackend.dsn(data_dir),
        **options,
    )


async def call(stack: Stack, method: str, path: str, **kw: Any) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, stack.base_url + path, **kw) as reply,
    ):
        return reply.status, await reply.json()


async def export(stack: Stack, **params: str) -> list[dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(stack.base_url + "/api/v1/export", params=params) as reply,
    ):
        assert reply.status == 200, await reply.text()
        assert reply.content_type == "application/x-ndjson"
        return [json.loads(line) for line in (await reply.text()).splitlines()]


async def apply(stack: Stack, user: str, *ops: store_pb2.Op) -> list[common_pb2.Memory]:
    async with open_channel(stack.address("store")) as channel:
        reply = await store_pb2_grpc.StoreStub(channel).Apply(
            store_pb2.ApplyRequest(
                scope=common_pb2.Scope(user_id=user), ops=list(ops), actor="api"
            ),
            timeout=60,
        )
    return list(reply.memories)


def insert(user: str, layer: str, content: str, **fields: Any) -> store_pb2.Op:
    return store_pb2.Op(
        insert=store_pb2.NewMemory(
            owner=common_pb2.Owner(user_id=user, session_id="s1"),
            layer=LAYERS.index(layer) + 1,
            content=content,
            **fields,
        )
    )


def vector_line(user: str, n: int, model: str) -> str:
    """An import line of a raw turn with id f"{user}-{n:04d}", its vector of model and no
    keys: imported without the embedder."""
    vector = np.random.default_rng(n).standard_normal(384).astype("<f4")
    vector /= np.linalg.norm(vector)
    return json.dumps({
        "type": "memory",
        "memory": {"user_id": user, "id": f"{user}-{n:04d}", "session_id": "s1",
                   "content": f"Rowing log {n}: {n % 7} km on the river before work."},
        "vector": base64.b64encode(vector.tobytes()).decode(),
        "model_id": model,
        "keys": [],
    })


async def seed(stack: Stack, user: str) -> dict[str, str]:
    """Rows in all layers, turns with context, clause and fact keys, retired/restored rows, an
    edge."""
    added = []
    for text in ("I had a dentist appointment on Tuesday.", LONG_TEXT, "I drink green tea daily."):
        status, body = await call(
            stack, "POST", "/api/v1/add", json={"text": text, "user_id": user, "session_id": "s1"}
        )
        assert status == 200, body
        added.append(body["memory_id"])
    rows = await apply(
        stack,
        user,
        *(insert(user, layer, f"{layer} note: my favourite tea is sencha") for layer in LAYERS),
        insert(user, "l3_fact", "My favourite tea is oolong.", metadata_json='{"k": [1, 2]}'),
        insert(
            user,
            "l7_intention",
            "Call the dentist again",
            due_at=1_900_000_000.0,
            source_ids=[added[0]],
        ),
    )
    ids = {common_pb2.Layer.Name(row.layer).lower(): row.id for row in rows[:8]}
    old, again = rows[8].id, rows[9].id
    await apply(
        stack,
        user,
        store_pb2.Op(
            retire=store_pb2.RetireOp(
                id=old, superseded_how="replaced", superseded_by=ids["l3_fact"], drop_reason="x"
            )
        ),
        store_pb2.Op(retire=store_pb2.RetireOp(id=again, superseded_how="done")),
    )
    await apply(stack, user, store_pb2.Op(restore=store_pb2.RestoreOp(id=again)))
    status, listing = await call(
        stack, "POST", "/api/v1/list", json={"user_id": user, "layer": "l2_raw"}
    )
    turns = [m["memory_id"] for m in listing["memories"]]
    await apply(
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
    return {"retired": old, "restored": again, "dentist_turn": added[0], **ids}


async def observed(stack: Stack, user: str) -> dict[str, Any]:
    """What a user sees: every row, each row's history, search hits and edges."""
    status, listing = await call(
        stack,
        "POST",
        "/api/v1/list",
        json={"user_id": user, "limit": 1000, "include_superseded": True},
    )
    assert status == 200, listing
    history = {}
    for memory in listing["memories"]:
        status, body = await call(
            stack, "GET", "/api/v1/history", params={"user_id": user, "id": memory["memory_id"]}
        )
        assert status == 200, body
        history[memory["memory_id"]] = [
            {k: v for k, v in entry.items() if k != "seq"} for entry in body["history"]
        ]
    hits = {}
    for query in QUERIES:
        status, body = await call(
            stack, "POST", "/api/v1/search", json={"query": query, "user_id": user, "limit": 10}
        )
        assert status == 200, body
        hits[query] = {
            channel: [(m["memory_id"], round(m["score"], 4)) for m in items]
            for channel, items in body["memories"].items()
        }
    status, edges = await call(stack, "GET", "/api/v1/edges", params={"user_id": user})
    assert status == 200, edges
    return {"list": listing, "history": history, "hits": hits, "edges": edges}
