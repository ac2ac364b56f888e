"""What extraction reads before it asks the model, in one batched store read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.calibration import related_score
from shared.pb import common_pb2, store_pb2
from shared.store_client import PAGE, StoreClient

OPEN_LAYERS = [common_pb2.L7_INTENTION, common_pb2.L8_ENTITY]


@dataclass(frozen=True)
class Context:
    """A raw row and what its extraction is shown next to it."""

    raw: common_pb2.Memory
    vector: np.ndarray | None
    """The row's stored vector (None when the store holds none of its model)."""
    facts: list[common_pb2.ScoredMemory]
    """Live facts near the turn."""
    near_pages: list[common_pb2.ScoredMemory]
    """Entity pages near the turn."""
    open_rows: list[common_pb2.Memory]
    """Every live intention and entity page of the owner, newest first."""


def _near(scope: common_pb2.Scope, memory_id: str, layer: int, k: int) -> store_pb2.Read:
    """The k rows of a layer nearest the row, however far (min_score 0: the row's model, which
    sets the floor, is read in the same call)."""
    request = store_pb2.VectorSearchRequest(
        scope=scope, near_id=memory_id, layers=[layer], k=k  # type: ignore[list-item]
    )
    return store_pb2.Read(vector_search=request)


async def read_context(
    store: StoreClient,
    scope: common_pb2.Scope,
    memory_id: str,
    facts_k: int,
    pages_k: int,
) -> Context:
    """The row, its vector, the facts and pages related to it (the nearest, at the related
    score of the row's model or more), and the owner's open rows: one read (a second only when
    the open rows fill more than a page). NotFound when the row is not in scope."""
    reads = [
        store_pb2.Read(get=store_pb2.GetMemoryRequest(scope=scope, id=memory_id, with_vector=True)),
        _near(scope, memory_id, common_pb2.L3_FACT, facts_k),
        _near(scope, memory_id, common_pb2.L8_ENTITY, pages_k),
        store_pb2.Read(list=store_pb2.ListMemoriesRequest(
            scope=scope, layers=OPEN_LAYERS, limit=PAGE)),
    ]
    got, facts, pages, listed = await store.read_many(reads)
    rows = list(listed.list.memories)
    if len(rows) < listed.list.total:
        rows = await store.all_rows(store_pb2.ListMemoriesRequest(scope=scope, layers=OPEN_LAYERS))
    vector = np.asarray(got.get.vector, dtype=np.float32) if got.get.vector else None
    floor = related_score(got.get.memory.model_id)
    return Context(got.get.memory, vector, _related(facts, floor), _related(pages, floor), rows)


def _related(found: store_pb2.ReadResult, floor: float) -> list[common_pb2.ScoredMemory]:
    """The hits of a near read at floor or more."""
    return [hit for hit in found.vector_search.hits if hit.score >= floor]
