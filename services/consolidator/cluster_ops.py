"""The decisions of one cluster's plan: store ops after the similarity guards, without I/O."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

import numpy as np

from services.consolidator.plan import Drop, EdgeOp, EndEdge, Merge, Plan, Schema
from shared.layers import ARC
from shared.pb import common_pb2, store_pb2
from shared.store_client import retire_op
from shared.text import edge_key, may_repeat

MERGE_GUARD = 0.65
SCHEMA_DUPLICATE = 0.92


@dataclass
class Counts:
    """What one cluster's ops will change, added to the report once they are applied."""

    merged: int = 0
    dropped: int = 0
    schemas: int = 0
    edges: int = 0
    arc: bool = False

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.merged + other.merged,
            self.dropped + other.dropped,
            self.schemas + other.schemas,
            self.edges + other.edges,
            self.arc or other.arc,
        )


@dataclass
class ClusterOps:
    """A cluster's store ops and what they retire, insert and refuse."""

    core: list[store_pb2.Op] = field(default_factory=list)
    """Merges and drops: they land whole or the cluster counts as failed."""
    extra: list[store_pb2.Op] = field(default_factory=list)
    """Schemas, edges and the arc: left out when the store refuses them."""
    counts: Counts = field(default_factory=Counts)
    retired: list[str] = field(default_factory=list)
    inserted: list[str] = field(default_factory=list)
    merged_into: dict[str, str] = field(default_factory=dict)
    """The new fact that replaced each merged fact, by id."""
    refused: list[str] = field(default_factory=list)

    def __add__(self, other: ClusterOps) -> ClusterOps:
        return ClusterOps(
            [*self.core, *other.core],
            [*self.extra, *other.extra],
            self.counts + other.counts,
            [*self.retired, *other.retired],
            [*self.inserted, *other.inserted],
            {**self.merged_into, **other.merged_into},
            [*self.refused, *other.refused],
        )

    def members(self, before: Sequence[str]) -> list[str]:
        """The cluster's members once these ops are applied."""
        gone = set(self.retired)
        return [m for m in before if m not in gone] + self.inserted


@dataclass(frozen=True)
class Fetched:
    """What the decisions about one cluster read, fetched before they run."""

    pass_id: str
    owner: common_pb2.Owner
    """The cluster's user and agent (every fact of a cluster has that agent), who the pass's
    rows belong to."""
    cluster_id: int
    facts: Sequence[common_pb2.Memory]
    """The cluster's facts as shown to the model (plan numbers index them)."""
    fact_vectors: Mapping[str, np.ndarray]
    text_vectors: Mapping[str, np.ndarray]
    """The vectors of the plan's merge and schema texts."""
    schemas: Sequence[tuple[str, np.ndarray]]
    """The known schemas shown to the model, each text with its vector."""
    edges: Sequence[store_pb2.Edge]
    """The edges shown to the model (end_edges index them)."""
    owner_edges: Sequence[store_pb2.Edge]
    arcs: Sequence[common_pb2.Memory] | None
    """The owner's arc summaries, or None when this call did not ask for the arc."""
    arc_evidence: Sequence[str] = ()
    """What the arc the model builds on rests on now (cluster_pass.standing)."""


def cluster_ops(plan: Plan, data: Fetched, *, graph: bool) -> ClusterOps:
    """The store ops of a checked plan after the similarity guards: core first, then extras."""
    merged = merge_ops(plan.merges, data)
    dropped = drop_ops(plan.drops, data)
    ops = merged + dropped
    ops += schema_ops(plan.schemas, data, merged.merged_into)
    if graph:
        ops += edge_ops(plan.edges, plan.end_edges, data, merged.merged_into)
        ops += arc_ops(plan.arc, data, merged.merged_into, set(dropped.retired))
    return ops


def merge_ops(merges: Sequence[Merge], data: Fetched) -> ClusterOps:
    """Each merge as one new fact retiring its group, unless a member is too far from it."""
    ops = ClusterOps()
    for merge in merges:
        group = [data.facts[i] for i in merge.facts]
        newest = max(group, key=lambda f: f.created_at)
        text = merge.text or newest.content
        target = data.text_vectors.get(text)
        if target is None:
            target = data.fact_vectors[newest.id]
        score = min(float(data.fact_vectors[f.id] @ target) for f in group)
        if score < MERGE_GUARD:
            ops.refused.append(
                f"merge of {len(group)} facts: similarity {score:.2f} is under the "
                f"{MERGE_GUARD} guard"
            )
            continue
        row = _merged_row(group, newest, text, data.cluster_id, data.pass_id)
        ops.core.append(store_pb2.Op(insert=row))
        ops.inserted.append(row.id)
        for fact in group:
            ops.core.append(pass_retire(fact.id, "merged", row.id, "", data.pass_id))
            ops.retired.append(fact.id)
            ops.merged_into[fact.id] = row.id
        ops.counts.merged += len(group)
    return ops


def _merged_row(
    group: Sequence[common_pb2.Memory],
    newest: common_pb2.Memory,
    text: str,
    cluster_id: int,
    pass_id: str,
) -> store_pb2.NewMemory:
    row = store_pb2.NewMemory(
        id=str(uuid.uuid4()),
        owner=newest.owner,
        layer=common_pb2.L3_FACT,
        content=text,
        label=newest.label,
        source_ids=list(dict.fromkeys(s for f in group for s in f.source_ids)),
        metadata_json=json.dumps({"merged_from": [f.id for f in group], "cluster": cluster_id}),
        count=sum(max(f.count, 1) for f in group),
        write_mode=newest.write_mode,
        pass_id=pass_id,
        # The clock its date is on: the newest fact's, whose date it keeps.
        utc_offset_minutes=newest.utc_offset_minutes,
    )
    if newest.HasField("event_at"):
        row.event_at = newest.event_at
    return row


def drop_ops(drops: Sequence[Drop], data: Fetched) -> ClusterOps:
    """Each drop retires its fact with the model's reason."""
    ops = ClusterOps()
    for drop in drops:
        fact = data.facts[drop.fact]
        ops.core.append(pass_retire(fact.id, "dropped", "", drop.reason, data.pass_id))
        ops.retired.append(fact.id)
        ops.counts.dropped += 1
    return ops


def repeats_known(
    text: str, vector: np.ndarray, known: Sequence[tuple[str, np.ndarray]]
) -> bool:
    """Whether a new pattern says again what a known one says: its vector as near as
    SCHEMA_DUPLICATE, and the same numbers and as many negations (shared.text.may_repeat), so a
    pattern that changed ("runs 3 times a week" after "5 times") is not taken for the old."""
    return any(
        float(seen @ vector) >= SCHEMA_DUPLICATE and may_repeat(text, said)
        for said, seen in known
    )


def schema_ops(
    schemas: Sequence[Schema], data: Fetched, merged_into: Mapping[str, str]
) -> ClusterOps:
    """Each schema as an L6 row citing its facts (or their merges), unless it repeats one."""
    ops = ClusterOps()
    known = list(data.schemas)
    for schema in schemas:
        vector = data.text_vectors[schema.text]
        if repeats_known(schema.text, vector, known):
            ops.refused.append(f"schema {schema.text[:60]!r}: repeats a known pattern")
            continue
        known.append((schema.text, vector))
        shown = [data.facts[i] for i in schema.facts]
        row = store_pb2.NewMemory(
            owner=data.owner,
            layer=common_pb2.L6_SCHEMA,
            content=schema.text,
            source_ids=_evidence(shown, merged_into),
            metadata_json=json.dumps({"cluster": data.cluster_id, "turns": _turns(shown)}),
            pass_id=data.pass_id,
        )
        ops.extra.append(store_pb2.Op(insert=row))
        ops.counts.schemas += 1
    return ops


def edge_ops(
    edges: Sequence[EdgeOp],
    end_edges: Sequence[EndEdge],
    data: Fetched,
    merged_into: Mapping[str, str],
) -> ClusterOps:
    """Each edge put (with an L5 row when its names are new to the owner, ignoring case as the
    store does: shared.text.edge_key); each end applied."""
    ops = ClusterOps()
    live = {edge_key(e.subject, e.relation, e.object) for e in data.owner_edges}
    for n, edge in enumerate(edges):
        shown = [data.facts[i] for i in edge.facts]
        put = store_pb2.PutEdgeOp(
            owner=common_pb2.Owner(
                user_id=shown[0].owner.user_id, agent_id=shown[0].owner.agent_id
            ),
            subject=edge.subject,
            relation=edge.relation,
            object=edge.object,
            source_ids=_turns(shown),
            fact_ids=_evidence(shown, merged_into),
            pass_id=data.pass_id,
            weight=float(len(_turns(shown))),
        )
        if edge.valid_from is not None:
            put.valid_from = edge.valid_from
        key = edge_key(edge.subject, edge.relation, edge.object)
        if key not in live:
            live.add(key)
            ops.extra.append(store_pb2.Op(insert=_knowledge_row(put, f"k{n}")))
            put.memory_id = f"$k{n}"
            ops.counts.edges += 1
        ops.extra.append(store_pb2.Op(put_edge=put))
    for end in end_edges:
        op = store_pb2.EndEdgeOp(id=data.edges[end.edge].id, pass_id=data.pass_id)
        if end.valid_to is not None:
            op.valid_to = end.valid_to
        ops.extra.append(store_pb2.Op(end_edge=op))
    return ops


def _knowledge_row(put: store_pb2.PutEdgeOp, ref: str) -> store_pb2.NewMemory:
    """The L5 row stating an edge's triple, which the edge then points at by ref."""
    return store_pb2.NewMemory(
        owner=put.owner,
        layer=common_pb2.L5_KNOWLEDGE,
        content=f"{put.subject} {put.relation} {put.object}",
        source_ids=list(put.fact_ids),
        metadata_json=json.dumps(
            {
                "subject": put.subject,
                "relation": put.relation,
                "object": put.object,
                "sources": list(put.source_ids),
            }
        ),
        pass_id=put.pass_id,
        ref=ref,
    )


def current_arc(arcs: Sequence[common_pb2.Memory]) -> common_pb2.Memory | None:
    """The arc the model is shown to build on, of the owner's arc summaries."""
    return arcs[0] if arcs else None


def arc_ops(
    arc: str, data: Fetched, merged_into: Mapping[str, str], dropped: Set[str] = frozenset()
) -> ClusterOps:
    """The new arc summary replacing the owner's old ones, if this call asked for it: it rests
    on the facts it was shown and what the arc it builds on rests on now, as they stand after
    the pass (a merged one by its merge, a dropped one not at all), each once, so a forget of
    any of them takes it down and its evidence does not grow with every pass."""
    if not arc or data.arcs is None:
        return ClusterOps()
    shown = [*(f.id for f in data.facts), *data.arc_evidence]
    sources = [merged_into.get(i, i) for i in shown if i not in dropped]
    row = store_pb2.NewMemory(
        owner=data.owner,
        layer=common_pb2.L4_SUMMARY,
        content=arc,
        label=ARC,
        source_ids=list(dict.fromkeys(sources)),
        pass_id=data.pass_id,
        ref="arc",
    )
    ops = ClusterOps(counts=Counts(arc=True))
    ops.extra.append(store_pb2.Op(insert=row))
    ops.extra += [pass_retire(a.id, "replaced", "$arc", "", data.pass_id) for a in data.arcs]
    return ops


def pass_retire(memory_id: str, how: str, by: str, reason: str, pass_id: str) -> store_pb2.Op:
    """A Retire op that undo of the pass can find."""
    op = retire_op(memory_id, how, by, reason)
    op.retire.pass_id = pass_id
    return op


def _evidence(facts: Sequence[common_pb2.Memory], merged_into: Mapping[str, str]) -> list[str]:
    return list(dict.fromkeys(merged_into.get(f.id, f.id) for f in facts))


def _turns(facts: Sequence[common_pb2.Memory]) -> list[str]:
    return list(dict.fromkeys(s for f in facts for s in f.source_ids))
