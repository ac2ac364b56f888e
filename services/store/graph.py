"""The L5 graph: edges put and ended inside an Apply, edges listed, memories' nearest links."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

import numpy as np

from services.store.cascade import edge_stands
from services.store.core import Core, Write, target
from services.store.model import Edge, EndEdge, PutEdge, Reach
from services.store.rows import Rows
from services.store.validate import check_edge_span, check_ids, page_offset, page_size
from shared.errors import InvalidArgument, NotFound
from shared.text import edge_key


async def put_edge(w: Write, reach: Reach, op: PutEdge, where: str) -> None:
    """Adds an edge (stale if its evidence went while it was being written), or the op's
    evidence to the live edge with the same owner and names (ignoring case:
    shared.text.edge_key)."""
    if op.memory_id:
        await target(w.tx, reach, op.memory_id)
    key = edge_key(op.subject, op.relation, op.object)
    existing = await w.tx.live_edge(op.user_id, op.agent_id, key)
    if existing is not None:
        await _more_evidence(w, existing, op)
        return
    if len(set(op.source_ids)) < 2:
        raise InvalidArgument(f"{where}: a new edge needs at least two distinct evidence turns")
    edge = Edge(
        id=str(uuid.uuid4()),
        user_id=op.user_id,
        agent_id=op.agent_id,
        subject=op.subject,
        relation=op.relation,
        object=op.object,
        weight=op.weight or 1.0,
        source_ids=tuple(dict.fromkeys(op.source_ids)),
        fact_ids=tuple(dict.fromkeys(op.fact_ids)),
        memory_id=op.memory_id,
        recorded_at=w.now,
        invalidated_at=None,
        valid_from=op.valid_from,
        valid_to=op.valid_to,
        stale=not await edge_stands(w, op.user_id, op.memory_id, op.fact_ids),
        pass_id=op.pass_id,
    )
    await w.tx.insert_edge(edge)
    if op.pass_id:
        await w.tx.record_pass_change(op.pass_id, "edge_new", edge.id)


async def _more_evidence(w: Write, existing: Edge, op: PutEdge) -> None:
    sources = tuple(dict.fromkeys((*existing.source_ids, *op.source_ids)))
    facts = tuple(dict.fromkeys((*existing.fact_ids, *op.fact_ids)))
    if sources == existing.source_ids and facts == existing.fact_ids:
        return
    await w.tx.update_edge(existing.id, source_ids=sources, fact_ids=facts)
    if op.pass_id:
        before = json.dumps({"source_ids": existing.source_ids, "fact_ids": existing.fact_ids})
        await w.tx.record_pass_change(op.pass_id, "edge_evidence", existing.id, before)


async def end_edge(w: Write, reach: Reach, op: EndEdge, where: str) -> None:
    """Ends a live edge: no longer true from valid_to (or now), learned now. Its L5 row is true
    until then too (search leaves out what is no longer true)."""
    edge = await w.tx.get_edge(op.id)
    if edge is None or not reach.contains(edge.user_id, edge.agent_id):
        raise NotFound(f"{where}: edge {op.id!r} not found")
    if edge.invalidated_at is not None:
        return
    ends = op.valid_to if op.valid_to else w.now
    check_edge_span(f"{where}: edge {op.id!r}", edge.valid_from, ends)
    await w.tx.update_edge(edge.id, invalidated_at=w.now, valid_to=ends)
    row = await w.tx.get(edge.memory_id) if edge.memory_id else None
    if row is not None:
        await w.change(row, "update", {"valid_to": ends}, f"its edge {edge.id} ended")
    if op.pass_id:
        before = {"valid_to": edge.valid_to, "invalidated_at": None}
        if row is not None:
            before["memory_valid_to"] = row.valid_to
        await w.tx.record_pass_change(op.pass_id, "edge_end", edge.id, json.dumps(before))


async def list_edges(
    repo: Rows, reach: Reach, as_of: float | None, include_stale: bool, limit: int, offset: int
) -> tuple[list[Edge], int]:
    """A page of a reach's edges: the live graph now, or as it stood at as_of."""
    return await repo.list_edges(reach, as_of, include_stale, page_size(limit), page_offset(offset))


async def neighbours(
    core: Core, reach: Reach, memory_ids: Sequence[str], k: int
) -> list[tuple[str, str, float]]:
    """Each memory's k nearest among the given ones: (from, to, cosine), nearest first."""
    if k < 0:
        raise InvalidArgument("k must not be negative")
    ids = list(dict.fromkeys(memory_ids))
    check_ids(ids)
    for memory_id in ids:
        await core.get(reach, memory_id)
    vectors = await core.repo.memory_vectors(ids, core.model.model_id)
    kept = [i for i in ids if i in vectors]
    if k == 0 or len(kept) < 2:
        return []
    matrix = np.stack([vectors[i] for i in kept])
    # Stored vectors are unit length only to half precision: a text and its copy scored 1.002.
    scores = np.clip(matrix @ matrix.T, -1.0, 1.0)
    np.fill_diagonal(scores, -np.inf)
    links: list[tuple[str, str, float]] = []
    for a, memory_id in enumerate(kept):
        for b in np.argsort(-scores[a], kind="stable")[: min(k, len(kept) - 1)]:
            links.append((memory_id, kept[b], float(scores[a, b])))
    return links
