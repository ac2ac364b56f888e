"""One cluster's call: what it shows the model, the plan read back, its ops applied."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.consolidator.cluster_ops import (
    ClusterOps,
    Counts,
    Fetched,
    cluster_ops,
    current_arc,
)
from services.consolidator.clusters import Cluster, members_hash
from services.consolidator.plan import PartialReply, Plan, read_plan
from services.consolidator.prompt import (
    EDGES_SHOWN,
    SCHEMAS_SHOWN,
    consolidation_messages,
    consolidation_schema,
    reply_keys,
)
from services.consolidator.survey import ACTOR, Owner, cluster_key, pass_key
from services.consolidator.vectors import Vectors
from shared.errors import ServiceError, Unavailable
from shared.layers import ARC
from shared.llm import LlmClient, LlmMalformed, LlmUnavailable
from shared.pb import common_pb2, store_pb2
from shared.store_client import GraphStoreClient, state_op

if TYPE_CHECKING:
    from services.consolidator.passes import Report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shown:
    """What the call shows the model besides the cluster's facts."""

    schemas: Sequence[common_pb2.Memory]
    owner_edges: Sequence[store_pb2.Edge]
    edges: Sequence[store_pb2.Edge]
    """The owner's edges that cite a member, as many as the prompt shows."""
    arcs: Sequence[common_pb2.Memory] | None
    """The owner's arc summaries, or None when this call does not ask for the arc."""
    arc_evidence: Sequence[str] = ()
    """What the arc the model builds on rests on now (standing)."""


CARRIED_ON = ("merged", "restated")
"""How a row is retired when its value lives on in the row that retired it."""
MAX_HOPS = 8
"""The successors standing follows from a retired row (a chain longer than this is cut)."""


async def run_cluster(
    store: GraphStoreClient,
    llm: LlmClient,
    vectors: Vectors,
    graph: bool,
    report: Report,
    owner: Owner,
    cluster: Cluster,
) -> bool:
    """One call for one cluster, its checked ops applied in one transaction; True if done.

    Any failure is this cluster's alone: logged, reported and (returning False) charged to it,
    so one cluster that trips a bug cannot fail the pass of every other cluster and owner.
    """
    where = f"cluster {owner.id}#{cluster.id}"
    # Claimed before the first await, so one cluster per owner and pass asks for the arc; a
    # failed cluster gives the claim back, so a later cluster of the pass asks instead.
    ask_arc = graph and not owner.arc_asked
    owner.arc_asked = True
    try:
        done = await _run_cluster(
            store, llm, vectors, graph, report, owner, cluster, ask_arc, where
        )
    except Exception as exc:
        log.exception("%s failed", where)
        report.errors.append(f"{where}: failed ({type(exc).__name__}); see the consolidator log")
        done = False
    if ask_arc and not done:
        owner.arc_asked = False
    return done


async def _run_cluster(
    store: GraphStoreClient,
    llm: LlmClient,
    vectors: Vectors,
    graph: bool,
    report: Report,
    owner: Owner,
    cluster: Cluster,
    ask_arc: bool,
    where: str,
) -> bool:
    facts = [owner.facts[m] for m in cluster.members if m in owner.facts]
    shown = await _shown(store, owner, cluster, ask_arc)
    try:
        plan = await _ask(llm, graph, report, facts, shown)
    except (LlmUnavailable, LlmMalformed, PartialReply) as exc:
        report.failed_calls += 1
        report.errors.append(f"{where}: {exc.message}; nothing was applied")
        return False
    fetched = await _fetched(vectors, report.pass_id, owner, cluster, facts, plan, shown)
    ops = cluster_ops(plan, fetched, graph=graph)
    refused = [*plan.refused, *ops.refused]
    report.dropped_ops += len(refused)
    report.errors += [f"{where}: refused {why}" for why in refused]
    members = ops.members(cluster.members)
    done = Cluster(cluster.id, members, members_hash(members), 0, 0.0, "")
    record = [
        state_op(cluster_key(owner.id, cluster.id), done.to_json()),
        state_op(
            pass_key(report.pass_id, owner.id, cluster.id),
            {"retired": ops.retired, "inserted": ops.inserted},
        ),
    ]
    counts = await _apply(store, report, owner, ops, record, where)
    if counts is None:
        return False
    cluster.members, cluster.done, cluster.fails = members, done.done, 0
    cluster.skip_until, cluster.skip_hash = 0.0, ""
    for fact_id in ops.retired:
        owner.facts.pop(fact_id, None)
    report.merged += counts.merged
    report.dropped += counts.dropped
    report.schemas += counts.schemas
    report.edges += counts.edges
    report.arc = report.arc or counts.arc
    return True


async def _shown(store: GraphStoreClient, owner: Owner, cluster: Cluster, ask_arc: bool) -> Shown:
    schemas, owner_edges, arcs = await asyncio.gather(
        store.list_rows(
            store_pb2.ListMemoriesRequest(
                scope=owner.scope, layers=[common_pb2.L6_SCHEMA], limit=SCHEMAS_SHOWN
            )
        ),
        store.edges(owner.scope),
        _arcs(store, owner, ask_arc),
    )
    members = set(cluster.members)
    edges = [e for e in owner_edges if members & set(e.fact_ids)][:EDGES_SHOWN]
    built_on = current_arc(arcs or [])
    evidence = await standing(store, owner.scope, built_on.source_ids) if built_on else []
    return Shown(schemas, owner_edges, edges, arcs, evidence)


async def standing(
    store: GraphStoreClient, scope: common_pb2.Scope, ids: Sequence[str]
) -> list[str]:
    """The rows ids stand for now, each once: a live one itself, a retired one the live row
    its value was merged or restated into since (none for one dropped, replaced or gone)."""
    found: list[str] = []
    seen: set[str] = set()
    todo = list(dict.fromkeys(ids))
    for _ in range(MAX_HOPS):
        if not todo:
            break
        seen.update(todo)
        rows = await store.get_many(scope, todo)
        found += [row.id for row in rows if row.status == "active"]
        todo = [
            row.superseded_by
            for row in rows
            if row.superseded_how in CARRIED_ON
            and row.superseded_by
            and row.superseded_by not in seen
        ]
    return list(dict.fromkeys(found))


async def _arcs(
    store: GraphStoreClient, owner: Owner, ask_arc: bool
) -> list[common_pb2.Memory] | None:
    if not ask_arc:
        return None
    summaries = await store.all_rows(
        store_pb2.ListMemoriesRequest(scope=owner.scope, layers=[common_pb2.L4_SUMMARY])
    )
    return [s for s in summaries if s.label == ARC]


async def _ask(
    llm: LlmClient,
    graph: bool,
    report: Report,
    facts: Sequence[common_pb2.Memory],
    shown: Shown,
) -> Plan:
    ask_arc = shown.arcs is not None
    arc = None
    if shown.arcs is not None:
        built_on = current_arc(shown.arcs)
        arc = built_on.content if built_on else ""
    messages = consolidation_messages(facts, shown.schemas, shown.edges, arc, graph)
    reply = await llm.json_reply(messages, consolidation_schema(graph, ask_arc))
    report.llm_calls += 1
    return read_plan(
        reply,
        reply_keys(graph, ask_arc),
        [list(f.source_ids) for f in facts],
        [e.valid_from if e.HasField("valid_from") else None for e in shown.edges],
    )


async def _fetched(
    vectors: Vectors,
    pass_id: str,
    owner: Owner,
    cluster: Cluster,
    facts: Sequence[common_pb2.Memory],
    plan: Plan,
    shown: Shown,
) -> Fetched:
    """Every vector the decisions compare, embedded before they run."""
    texts = [t for t in [*(m.text for m in plan.merges), *(s.text for s in plan.schemas)] if t]
    known = shown.schemas if plan.schemas else []
    fact_vectors, text_vectors, schema_vectors = await asyncio.gather(
        vectors.of_rows(facts),
        vectors.of_texts(texts),
        vectors.of_rows(known),
    )
    return Fetched(
        pass_id=pass_id,
        owner=common_pb2.Owner(user_id=owner.user_id, agent_id=owner.agent_id),
        cluster_id=cluster.id,
        facts=facts,
        fact_vectors=fact_vectors,
        text_vectors=dict(zip(texts, text_vectors, strict=True)),
        schemas=[(s.content, schema_vectors[s.id]) for s in known],
        edges=shown.edges,
        owner_edges=shown.owner_edges,
        arcs=shown.arcs,
        arc_evidence=shown.arc_evidence,
    )


async def _apply(
    store: GraphStoreClient,
    report: Report,
    owner: Owner,
    ops: ClusterOps,
    record: list[store_pb2.Op],
    where: str,
) -> Counts | None:
    """Applies the ops with the cluster's record; without the extras if only they fail."""
    core = [*ops.core, *record]
    reason = f"consolidation pass {report.pass_id}"
    try:
        await store.apply(owner.scope, [*core, *ops.extra], ACTOR, reason)
    except Unavailable as exc:
        report.failed_calls += 1
        report.errors.append(f"{where}: the store failed: {exc.message}")
        return None
    except ServiceError as exc:
        if not ops.extra:
            report.errors.append(f"{where}: applying failed: {exc.message}")
            return None
        try:
            await store.apply(owner.scope, core, ACTOR, reason)
        except ServiceError as again:
            report.errors.append(f"{where}: applying failed: {again.message}")
            return None
        report.errors.append(
            f"{where}: schemas, edges or the arc could not be written ({exc.message}); "
            "merges and drops were applied"
        )
        return Counts(ops.counts.merged, ops.counts.dropped)
    return ops.counts
