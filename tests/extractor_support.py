"""Helpers for the extractor tests: a REST client and direct store reads."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp

from shared.layers import LAYERS_BY_NAME
from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel

STACK = ["store", "search", "extractor", "gateway"]


def new_user() -> str:
    """A user id no other test uses."""
    return f"user-{uuid.uuid4().hex[:8]}"


@dataclass
class Api:
    """A REST client for one gateway, plus direct reads of its store."""

    base_url: str
    store_address: str

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, Any]:
        """Status and decoded JSON body of one request."""
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.base_url + path, **kw) as reply,
        ):
            return reply.status, await reply.json()

    async def ok(self, method: str, path: str, **kw: Any) -> Any:
        """The body of a request that must answer 200."""
        status, body = await self.call(method, path, **kw)
        assert status == 200, body
        return body

    async def add(self, text: str, user_id: str, **fields: Any) -> dict[str, Any]:
        """Writes a turn."""
        return await self.ok(  # type: ignore[no-any-return]
            "POST", "/api/v1/add", json={"text": text, "user_id": user_id, **fields}
        )

    async def status(self) -> dict[str, Any]:
        """GET /api/v1/status."""
        return await self.ok("GET", "/api/v1/status")  # type: ignore[no-any-return]

    async def rows(
        self, user_id: str, layer: str, *, retired: bool = True
    ) -> list[common_pb2.Memory]:
        """Every row of one layer of a user, oldest first, straight from the store."""
        async with open_channel(self.store_address) as channel:
            reply = await store_pb2_grpc.StoreStub(channel).ListMemories(
                store_pb2.ListMemoriesRequest(
                    scope=common_pb2.Scope(user_id=user_id),
                    layers=[LAYERS_BY_NAME[layer]],  # type: ignore[list-item]
                    include_superseded=retired,
                    limit=1000,
                    order="oldest",
                ),
                timeout=10,
            )
        return list(reply.memories)

    async def row(self, user_id: str, memory_id: str) -> common_pb2.Memory:
        """One row of a user, straight from the store."""
        async with open_channel(self.store_address) as channel:
            reply = await store_pb2_grpc.StoreStub(channel).GetMemory(
                store_pb2.GetMemoryRequest(
                    scope=common_pb2.Scope(user_id=user_id), id=memory_id
                ),
                timeout=10,
            )
        return reply.memory

    async def search(self, query: str, user_id: str, **fields: Any) -> list[dict[str, Any]]:
        """Every hit of a search, across channels."""
        body = await self.ok(
            "POST", "/api/v1/search", json={"query": query, "user_id": user_id, **fields}
        )
        return [item for items in body["memories"].values() for item in items]


def by_content(rows: list[common_pb2.Memory], text: str) -> common_pb2.Memory:
    """The one row whose content is text."""
    found = [r for r in rows if r.content == text]
    assert len(found) == 1, [(r.content, r.status) for r in rows]
    return found[0]
