"""Graph-assisted recall: the memories behind the L5 edges of entities a query names."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.search.entities import query_entities
from services.search.model import Candidate, SearchContext
from shared.text import name_key

MAX_GRAPH_MEMORIES = 20
"""At most this many edge memories and evidence facts are fetched for one query."""

GRAPH_SHARE = 0.5
"""A memory only the graph found enters at this share of the best fused score."""

GRAPH_BOOST = 0.1
"""How much more a memory the sources found is worth when the graph also connects it."""


@dataclass(frozen=True, slots=True)
class GraphEdge:
    """One live L5 edge: the two nodes it joins and the memories behind it."""

    subject: str
    object: str
    fact_ids: tuple[str, ...] = ()
    memory_id: str = ""


def linked_memory_ids(edges: Iterable[GraphEdge], names: Sequence[str]) -> list[str]:
    """Ids of the edge memories and evidence facts of edges touching a named node, in order.

    A node matches when its label equals one of the names, ignoring case (shared.text.name_key).
    """
    wanted = {name_key(n.strip()) for n in names if n.strip()}
    if not wanted:
        return []
    ids: list[str] = []
    for edge in edges:
        if name_key(edge.subject.strip()) in wanted or name_key(edge.object.strip()) in wanted:
            if edge.memory_id:
                ids.append(edge.memory_id)
            ids.extend(edge.fact_ids)
    return list(dict.fromkeys(ids))[:MAX_GRAPH_MEMORIES]


def graph_names(text: str, edges: Iterable[GraphEdge]) -> list[str]:
    """The names a query mentions: capitalised ones, and node labels it holds in any case."""
    nodes = dict.fromkeys(label for e in edges for label in (e.subject, e.object))
    return query_entities(text, known=nodes)


def join_graph(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Adds the memories the graph connects to the query's entities, with a modest score.

    One the sources already found gets a small boost; one they missed enters at a share of the
    best fused score, so it shows when nothing closer does rather than outranking direct hits.
    """
    if not ctx.graph:
        return ranked
    layers = set(ctx.query.layers)
    by_id = {c.memory_id: c for c in ranked}
    top = max((c.fused for c in ranked), default=0.0) or 1.0
    out = list(ranked)
    for candidate in ctx.graph:
        if layers and candidate.layer not in layers:
            continue
        found = by_id.get(candidate.memory_id)
        if found is not None:
            found.fused *= 1.0 + GRAPH_BOOST
            continue
        candidate.fused = GRAPH_SHARE * top
        candidate.graph = True
        by_id[candidate.memory_id] = candidate
        out.append(candidate)
    out.sort(key=lambda c: -c.fused)
    return out
