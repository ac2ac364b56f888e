"""The parts every room of the store shares: database, indexes, embedder, model, write lock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from services.store.index import VectorIndexes
from services.store.model import MemoryRow, Reach
from services.store.repo import Repo
from shared.errors import Conflict, InvalidArgument, NotFound


class Embedder(Protocol):
    """What the store needs from the embedder service."""

    async def embed(
        self, texts: Sequence[str], *, is_query: bool = False
    ) -> tuple[np.ndarray, str]: ...


@dataclass(frozen=True)
class VectorModel:
    """The embedding model the store's vectors come from, and why searching may be refused."""

    model_id: str
    ndim: int
    mismatch: str = ""


@dataclass
class Core:
    """The store's database, indexes, embedder and model, and the lock every write takes."""

    repo: Repo
    indexes: VectorIndexes | None
    embedder: Embedder
    model: VectorModel
    alias_group: Callable[[str], tuple[str, ...]]
    exact_up_to: int
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def reach(self, user_id: str, agent_id: str = "", all_users: bool = False) -> Reach:
        """The owners a scope reaches: the user's alias group (or everyone), maybe one agent."""
        if all_users:
            return Reach(None, agent_id)
        if not user_id:
            raise InvalidArgument("scope.user_id is required (or scope.all_users)")
        return Reach(self.alias_group(user_id), agent_id)

    async def get(self, reach: Reach, memory_id: str) -> MemoryRow:
        """One row, if the reach owns it."""
        row = await self.repo.get(memory_id) if memory_id else None
        if row is None or not reach.contains(row.user_id, row.agent_id):
            raise NotFound(f"memory {memory_id!r} not found")
        return row

    async def embed(self, texts: list[str]) -> np.ndarray:
        """The vectors of texts, refused when the embedder's model is not the store's."""
        if self.model.mismatch:
            raise Conflict(self.model.mismatch)
        vectors, model_id = await self.embedder.embed(texts)
        if model_id != self.model.model_id:
            raise Conflict(
                f"the embedder now runs {model_id!r} but the store holds "
                f"{self.model.model_id!r} vectors; restart the store to re-check"
            )
        return vectors
