"""One consolidation pass: clusters per owner, calls within a budget, checked ops applied."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import numpy as np

from services.consolidator.clusters import Cluster, assign, median, members_hash, rebuilt
from services.consolidator.config import ConsolidatorConfig
from services.consolidator.plan import PartialReply, Plan, read_patterns, read_plan
from services.consolidator.prompt import (
    CROSS_SCHEMA,
    CROSS_SCHEMAS_SHOWN,
    EDGES_SHOWN,
    SCHEMAS_SHOWN,
    consolidation_messages,
    consolidation_schema,
    cross_messages,
    reply_keys,
)
from shared.errors import Conflict, ServiceError, Unavailable
from shared.llm import LlmClient, LlmMalformed, LlmUnavailable
from shared.pb import common_pb2, store_pb2
from shared.store_client import GraphStoreClient, retire_op, state_op

log = logging.getLogger(__name__)

ACTOR = "consolidator"
STATE = "consolidator/"
DURATIONS_KEY = "consolidator/durations"
MERGE_GUARD = 0.65
SCHEMA_DUPLICATE = 0.92
SKIP_AFTER_FAILS = 3
SKIP_S = 24 * 3600.0
DURATIONS_KEPT = 20
ARC = "arc"


def cluster_key(owner: str, cluster_id: int) -> str:
    """The state key of one cluster."""
    return f"{STATE}cluster/{owner}/{cluster_id}"


def owner_key(owner: str) -> str:
    """The state key of an owner's schedule (cluster build time, cross-topic pass)."""
    return f"{STATE}owner/{owner}"


def _pass_key(pass_id: str, owner: str, cluster_id: int) -> str:
    return f"{STATE}pass/{pass_id}/{owner}/{cluster_id}"


def new_pass_id() -> str:
    """A pass id that sorts by time."""
    return "p" + datetime.now(UTC).strftime("%Y%m%d%H%M%S") + uuid.uuid4().hex[:8]


class Busy(Conflict):
    """Another pass is already running."""


class Embedder(Protocol):
    """What the pass needs from the embedder."""

    async def embed(
        self, texts: Sequence[str], *, is_query: bool = False
    ) -> tuple[np.ndarray, str]: ...


@dataclass
class Report:
    """What one pass did: the reference's report fields and a few of ours."""

    pass_id: str = ""
    started_at: float = 0.0
    facts_in: int = 0
    owners_run: int = 0
    owners_unchanged: int = 0
    skipped_owners: list[str] = field(default_factory=list)
    clusters_run: int = 0
    clusters_pending: int = 0
    merged: int = 0
    edges: int = 0
    dropped: int = 0
    schemas: int = 0
    cross_schemas: int = 0
    arc: bool = False
    pruned_raw: int = 0
    protected_raw: int = 0
    duration_ms: int = 0
    errors: list[str] = field(default_factory=list)
    dropped_ops: int = 0
    llm_calls: int = 0
    failed_calls: int = 0
    provider_down: bool = False


@dataclass
class Owner:
    """One person's live facts and topic clusters."""

    id: str
    facts: dict[str, common_pb2.Memory]
    clusters: list[Cluster]
    meta: dict[str, Any]
    arc_asked: bool = False

    @property
    def scope(self) -> common_pb2.Scope:
        """The person's scope (the store expands it to the alias group)."""
        return common_pb2.Scope(user_id=self.id)


@dataclass
class Counts:
    """What one cluster's ops will change, added to the report once they are applied."""

    merged: int = 0
    dropped: int = 0
    schemas: int = 0
    edges: int = 0
    arc: bool = False


class Consolidator:
    """Runs passes one at a time and remembers the last one's report."""

    def __init__(
        self,
        config: ConsolidatorConfig,
        store: GraphStoreClient,
        embedder: Embedder,
        llm: LlmClient,
        canonical_user: Callable[[str], str],
    ) -> None:
        self.config = config
        self.store = store
        self.embedder = embedder
        self.llm = llm
        self.canonical_user = canonical_user
        self.runs = 0
        self.last: Report | None = None
        self.last_at = 0.0
        self._lock = asyncio.Lock()
        self._vectors: dict[tuple[str, str], np.ndarray] = {}

    @property
    def running(self) -> bool:
        """Whether a pass is running now."""
        return self._lock.locked()

    # -- vectors --------------------------------------------------------------------------

    async def _embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        vectors, _ = await self.embedder.embed(list(texts))
        return vectors

    async def _vectors_of(self, rows: Sequence[common_pb2.Memory]) -> dict[str, np.ndarray]:
        """Each row's vector by id, embedding only the texts not seen before."""
        missing = [r for r in rows if (r.id, r.content) not in self._vectors]
        for start in range(0, len(missing), 256):
            chunk = missing[start : start + 256]
            vectors = await self._embed_texts([r.content for r in chunk])
            for row, vector in zip(chunk, vectors, strict=True):
                self._vectors[(row.id, row.content)] = vector
        return {r.id: self._vectors[(r.id, r.content)] for r in rows}

    # -- clusters -------------------------------------------------------------------------

    async def survey(self, now: float) -> list[Owner]:
        """Every owner with live facts, its clusters brought up to date (and saved)."""
        state = await self.store.state(STATE)
        facts = await self.store.all_rows(
            store_pb2.ListMemoriesRequest(
                scope=common_pb2.Scope(all_users=True), layers=[common_pb2.L3_FACT], order="oldest"
            )
        )
        by_owner: dict[str, dict[str, common_pb2.Memory]] = {}
        for fact in facts:
            by_owner.setdefault(self.canonical_user(fact.owner.user_id), {})[fact.id] = fact
        stored: dict[str, list[Cluster]] = {}
        for key, value in state.items():
            if key.startswith(f"{STATE}cluster/"):
                owner = key[len(f"{STATE}cluster/") :].rsplit("/", 1)[0]
                stored.setdefault(owner, []).append(Cluster.from_json(json.loads(value)))
        owners: list[Owner] = []
        for owner_id in sorted(set(by_owner) | set(stored)):
            rows = by_owner.get(owner_id, {})
            old = sorted(stored.get(owner_id, []), key=lambda c: c.id)
            meta = json.loads(state.get(owner_key(owner_id), "{}"))
            vectors = await self._vectors_of(list(rows.values()))
            before = {c.id: c.to_json() for c in old}
            recluster = self.config.recluster_s
            if not old or (recluster and now - float(meta.get("built_at", 0)) > recluster):
                clusters = rebuilt(old, list(rows), vectors, self.config.batch)
                meta["built_at"] = now
                meta["next"] = len(clusters) + 1
                meta_changed = True
            else:
                clusters, next_id = assign(
                    [Cluster.from_json(c.to_json()) for c in old],
                    list(rows),
                    vectors,
                    self.config.batch,
                    int(meta.get("next", max((c.id for c in old), default=0) + 1)),
                )
                meta_changed = next_id != meta.get("next")
                meta["next"] = next_id
            ops = [
                state_op(cluster_key(owner_id, c.id), c.to_json())
                for c in clusters
                if before.get(c.id) != c.to_json()
            ]
            kept = {c.id for c in clusters}
            ops += [state_op(cluster_key(owner_id, i), None) for i in before if i not in kept]
            if meta_changed:
                ops.append(state_op(owner_key(owner_id), meta))
            if ops:
                await self.store.apply(owner_scope(owner_id), ops, ACTOR, "clusters")
            if rows:
                owners.append(Owner(owner_id, rows, clusters, meta))
        return owners

    async def pending(self) -> int:
        """How many clusters are due now (used at start to decide on a catch-up pass)."""
        now = time.time()
        async with self._lock:
            owners = await self.survey(now)
        return sum(1 for o in owners for c in o.clusters if c.due() and not c.skipped(now))

    # -- the pass -------------------------------------------------------------------------

    async def run_pass(self) -> Report:
        """Runs one pass now; Busy if one is already running."""
        if self._lock.locked():
            raise Busy("a consolidation pass is already running")
        async with self._lock:
            report = await self._pass()
            self.runs += 1
            self.last = report
            self.last_at = time.time()
            log.info(
                "pass %s: %d clusters run, %d pending, %d merged, %d dropped, %d schemas, "
                "%d edges, %d errors",
                report.pass_id,
                report.clusters_run,
                report.clusters_pending,
                report.merged,
                report.dropped,
                report.schemas,
                report.edges,
                len(report.errors),
            )
            return report

    async def _pass(self) -> Report:
        started = time.monotonic()
        now = time.time()
        report = Report(pass_id=new_pass_id(), started_at=now)
        owners = await self.survey(now)
        report.facts_in = sum(len(o.facts) for o in owners)
        jobs: deque[tuple[Owner, Cluster]] = deque()
        for owner in owners:
            due = [c for c in owner.clusters if c.due()]
            active = [c for c in due if not c.skipped(now)]
            for cluster in due:
                if cluster.skipped(now):
                    until = datetime.fromtimestamp(cluster.skip_until, UTC).isoformat()
                    report.errors.append(
                        f"cluster {owner.id}#{cluster.id} skipped after {SKIP_AFTER_FAILS} "
                        f"failed passes until {until} or until its facts change"
                    )
            if not due:
                report.owners_unchanged += 1
            elif not active:
                report.skipped_owners.append(owner.id)
            else:
                report.owners_run += 1
                jobs.extend((owner, c) for c in active)
        if jobs and not (self.llm.configured and self.llm.has_key()):
            report.errors.append("the LLM is not configured: no cluster was sent")
            report.clusters_pending = len(jobs)
        elif jobs:
            await self._run_jobs(report, jobs, started)
        await self._cross_topic(report, owners, now)
        await self._retain_raw(report)
        report.duration_ms = int((time.monotonic() - started) * 1000)
        return report

    async def _run_jobs(
        self, report: Report, jobs: deque[tuple[Owner, Cluster]], started: float
    ) -> None:
        state = await self.store.state(DURATIONS_KEY)
        durations: list[float] = json.loads(state.get(DURATIONS_KEY, "[]"))
        estimate = max(self.config.min_call_estimate_s, 1.25 * median(durations))
        failed: list[tuple[Owner, Cluster]] = []
        succeeded = 0

        async def worker() -> None:
            nonlocal succeeded
            while jobs:
                left = self.config.budget_s - (time.monotonic() - started)
                if left < estimate:
                    return
                owner, cluster = jobs.popleft()
                report.clusters_run += 1
                began = time.monotonic()
                if await self._run_cluster(report, owner, cluster):
                    succeeded += 1
                    durations.append(time.monotonic() - began)
                else:
                    failed.append((owner, cluster))

        await asyncio.gather(*(worker() for _ in range(self.config.parallel)))
        report.clusters_pending = len(jobs) + len(failed)
        ops = [state_op(DURATIONS_KEY, durations[-DURATIONS_KEPT:])] if succeeded else []
        if len(failed) >= 2 and succeeded == 0:
            report.provider_down = True
            report.errors.append(
                f"all {len(failed)} calls failed: the provider is taken to be down and no "
                "cluster is charged"
            )
        else:
            now = time.time()
            for owner, cluster in failed:
                cluster.fails += 1
                if cluster.fails >= SKIP_AFTER_FAILS:
                    cluster.skip_until = now + SKIP_S
                    cluster.skip_hash = cluster.hash
                    report.clusters_pending -= 1
                    report.errors.append(
                        f"cluster {owner.id}#{cluster.id} failed {cluster.fails} passes in a "
                        "row: skipped for 24h or until its facts change"
                    )
                ops.append(state_op(cluster_key(owner.id, cluster.id), cluster.to_json()))
        if ops:
            await self.store.apply(common_pb2.Scope(all_users=True), ops, ACTOR, "pass schedule")

    async def _run_cluster(self, report: Report, owner: Owner, cluster: Cluster) -> bool:
        """One call for one cluster, its checked ops applied in one transaction; True if done."""
        where = f"cluster {owner.id}#{cluster.id}"
        facts = [owner.facts[m] for m in cluster.members if m in owner.facts]
        schemas = await self.store.list_rows(
            store_pb2.ListMemoriesRequest(
                scope=owner.scope, layers=[common_pb2.L6_SCHEMA], limit=SCHEMAS_SHOWN
            )
        )
        members = set(cluster.members)
        owner_edges = await self.store.edges(owner.scope)
        edges = [e for e in owner_edges if members & set(e.fact_ids)][:EDGES_SHOWN]
        ask_arc = self.config.graph and not owner.arc_asked
        owner.arc_asked = True
        arcs: list[common_pb2.Memory] = []
        if ask_arc:
            summaries = await self.store.all_rows(
                store_pb2.ListMemoriesRequest(scope=owner.scope, layers=[common_pb2.L4_SUMMARY])
            )
            arcs = [s for s in summaries if s.label == ARC]
        messages = consolidation_messages(
            facts,
            schemas,
            edges,
            (arcs[0].content if arcs else "") if ask_arc else None,
            self.config.graph,
        )
        try:
            reply = await self.llm.json_reply(
                messages, consolidation_schema(self.config.graph, ask_arc)
            )
            report.llm_calls += 1
            plan = read_plan(
                reply,
                reply_keys(self.config.graph, ask_arc),
                [list(f.source_ids) for f in facts],
                len(edges),
            )
        except (LlmUnavailable, LlmMalformed, PartialReply) as exc:
            report.failed_calls += 1
            report.errors.append(f"{where}: {exc.message}; nothing was applied")
            owner.arc_asked = owner.arc_asked and not ask_arc
            return False
        core, extra, counts, members_after, retired, inserted = await self._ops(
            report.pass_id,
            owner,
            cluster,
            facts,
            plan,
            schemas,
            edges,
            owner_edges,
            arcs if ask_arc else None,
        )
        report.dropped_ops += len(plan.refused)
        report.errors += [f"{where}: refused {why}" for why in plan.refused]
        done = Cluster(cluster.id, members_after, members_hash(members_after), 0, 0.0, "")
        core.append(state_op(cluster_key(owner.id, cluster.id), done.to_json()))
        core.append(
            state_op(
                _pass_key(report.pass_id, owner.id, cluster.id),
                {"retired": retired, "inserted": inserted},
            )
        )
        reason = f"consolidation pass {report.pass_id}"
        try:
            await self.store.apply(owner.scope, [*core, *extra], ACTOR, reason)
        except Unavailable as exc:
            report.failed_calls += 1
            report.errors.append(f"{where}: the store failed: {exc.message}")
            return False
        except ServiceError as exc:
            if not extra:
                report.errors.append(f"{where}: applying failed: {exc.message}")
                return False
            report.errors.append(
                f"{where}: schemas, edges or the arc could not be written ({exc.message}); "
                "merges and drops were applied"
            )
            counts = Counts(counts.merged, counts.dropped)
            try:
                await self.store.apply(owner.scope, core, ACTOR, reason)
            except ServiceError as again:
                report.errors.append(f"{where}: applying failed: {again.message}")
                return False
        cluster.members, cluster.done, cluster.fails = members_after, done.done, 0
        cluster.skip_until, cluster.skip_hash = 0.0, ""
        for fact_id in retired:
            owner.facts.pop(fact_id, None)
        report.merged += counts.merged
        report.dropped += counts.dropped
        report.schemas += counts.schemas
        report.edges += counts.edges
        report.arc = report.arc or counts.arc
        return True

    async def _ops(
        self,
        pass_id: str,
        owner: Owner,
        cluster: Cluster,
        facts: list[common_pb2.Memory],
        plan: Plan,
        schemas: Sequence[common_pb2.Memory],
        edges: Sequence[store_pb2.Edge],
        owner_edges: Sequence[store_pb2.Edge],
        arcs: Sequence[common_pb2.Memory] | None,
    ) -> tuple[list[store_pb2.Op], list[store_pb2.Op], Counts, list[str], list[str], list[str]]:
        """The store ops of a checked plan after the similarity guards: core first, then extras."""
        core: list[store_pb2.Op] = []
        extra: list[store_pb2.Op] = []
        counts = Counts()
        members = list(cluster.members)
        retired: list[str] = []
        inserted: list[str] = []
        successor: dict[int, str] = {}
        fact_vectors = await self._vectors_of(facts)
        texts = [m.text or "" for m in plan.merges] + [s.text for s in plan.schemas]
        vectors = await self._embed_texts([t for t in texts if t])
        by_text = {t: v for t, v in zip([t for t in texts if t], vectors, strict=True)}
        for merge in plan.merges:
            group = [facts[i] for i in merge.facts]
            newest = max(group, key=lambda f: f.created_at)
            text = merge.text or newest.content
            target = by_text.get(text)
            if target is None:
                target = fact_vectors[newest.id]
            scores = [float(fact_vectors[f.id] @ target) for f in group]
            if min(scores) < MERGE_GUARD:
                plan.refused.append(
                    f"merge of {len(group)} facts: similarity {min(scores):.2f} is under the "
                    f"{MERGE_GUARD} guard"
                )
                continue
            new_id = str(uuid.uuid4())
            row = store_pb2.NewMemory(
                id=new_id,
                owner=newest.owner,
                layer=common_pb2.L3_FACT,
                content=text,
                label=newest.label,
                source_ids=list(dict.fromkeys(s for f in group for s in f.source_ids)),
                metadata_json=json.dumps(
                    {"merged_from": [f.id for f in group], "cluster": cluster.id}
                ),
                count=sum(max(f.count, 1) for f in group),
                write_mode=newest.write_mode,
                pass_id=pass_id,
            )
            if newest.HasField("event_at"):
                row.event_at = newest.event_at
            core.append(store_pb2.Op(insert=row))
            inserted.append(new_id)
            members.append(new_id)
            for i, fact in zip(merge.facts, group, strict=True):
                core.append(_retire(fact.id, "merged", new_id, "", pass_id))
                retired.append(fact.id)
                members.remove(fact.id)
                successor[i] = new_id
            counts.merged += len(group)
        for drop in plan.drops:
            fact = facts[drop.fact]
            core.append(_retire(fact.id, "dropped", "", drop.reason, pass_id))
            retired.append(fact.id)
            members.remove(fact.id)
            counts.dropped += 1
        if plan.schemas:
            known = await self._vectors_of(list(schemas))
            seen = [known[s.id] for s in schemas]
            for schema in plan.schemas:
                vector = by_text[schema.text]
                if seen and max(float(v @ vector) for v in seen) >= SCHEMA_DUPLICATE:
                    plan.refused.append(f"schema {schema.text[:60]!r}: repeats a known pattern")
                    continue
                seen.append(vector)
                evidence = list(dict.fromkeys(successor.get(i, facts[i].id) for i in schema.facts))
                turns = list(dict.fromkeys(s for i in schema.facts for s in facts[i].source_ids))
                extra.append(
                    store_pb2.Op(
                        insert=store_pb2.NewMemory(
                            owner=common_pb2.Owner(
                                user_id=owner.id, agent_id=facts[schema.facts[0]].owner.agent_id
                            ),
                            layer=common_pb2.L6_SCHEMA,
                            content=schema.text,
                            source_ids=evidence,
                            metadata_json=json.dumps({"cluster": cluster.id, "turns": turns}),
                            pass_id=pass_id,
                        )
                    )
                )
                counts.schemas += 1
        if self.config.graph:
            live = {(e.subject.lower(), e.relation.lower(), e.object.lower()) for e in owner_edges}
            for n, edge in enumerate(plan.edges):
                evidence = list(dict.fromkeys(successor.get(i, facts[i].id) for i in edge.facts))
                turns = list(dict.fromkeys(s for i in edge.facts for s in facts[i].source_ids))
                first = facts[edge.facts[0]].owner
                put = store_pb2.PutEdgeOp(
                    owner=common_pb2.Owner(user_id=first.user_id, agent_id=first.agent_id),
                    subject=edge.subject,
                    relation=edge.relation,
                    object=edge.object,
                    source_ids=turns,
                    fact_ids=evidence,
                    pass_id=pass_id,
                    weight=float(len(turns)),
                )
                if edge.valid_from is not None:
                    put.valid_from = edge.valid_from
                triple = (edge.subject.lower(), edge.relation.lower(), edge.object.lower())
                if triple not in live:
                    live.add(triple)
                    extra.append(
                        store_pb2.Op(
                            insert=store_pb2.NewMemory(
                                owner=put.owner,
                                layer=common_pb2.L5_KNOWLEDGE,
                                content=f"{edge.subject} {edge.relation} {edge.object}",
                                source_ids=evidence,
                                metadata_json=json.dumps(
                                    {
                                        "subject": edge.subject,
                                        "relation": edge.relation,
                                        "object": edge.object,
                                        "sources": turns,
                                    }
                                ),
                                pass_id=pass_id,
                                ref=f"k{n}",
                            )
                        )
                    )
                    put.memory_id = f"$k{n}"
                    counts.edges += 1
                extra.append(store_pb2.Op(put_edge=put))
            for end in plan.end_edges:
                op = store_pb2.EndEdgeOp(id=edges[end.edge].id, pass_id=pass_id)
                if end.valid_to is not None:
                    op.valid_to = end.valid_to
                extra.append(store_pb2.Op(end_edge=op))
            if plan.arc and arcs is not None:
                extra.append(
                    store_pb2.Op(
                        insert=store_pb2.NewMemory(
                            owner=common_pb2.Owner(user_id=owner.id),
                            layer=common_pb2.L4_SUMMARY,
                            content=plan.arc,
                            label=ARC,
                            pass_id=pass_id,
                            ref="arc",
                        )
                    )
                )
                extra += [_retire(a.id, "replaced", "$arc", "", pass_id) for a in arcs]
                counts.arc = True
        return core, extra, counts, members, retired, inserted

    # -- cross-topic schemas and raw retention --------------------------------------------

    async def _cross_topic(self, report: Report, owners: Sequence[Owner], now: float) -> None:
        every = self.config.cross_schema_every_s
        if every is None or not (self.llm.configured and self.llm.has_key()):
            return
        for owner in owners:
            if now - float(owner.meta.get("cross_at", 0)) < every:
                continue
            schemas = await self.store.list_rows(
                store_pb2.ListMemoriesRequest(
                    scope=owner.scope, layers=[common_pb2.L6_SCHEMA], limit=CROSS_SCHEMAS_SHOWN
                )
            )
            topics = {json.loads(s.metadata_json or "{}").get("cluster") for s in schemas}
            topics.discard(None)
            if len(schemas) < 4 or len(topics) < 2:
                continue
            try:
                reply = await self.llm.json_reply(cross_messages(schemas), CROSS_SCHEMA)
                report.llm_calls += 1
                patterns, refused = read_patterns(reply, len(schemas))
            except (LlmUnavailable, LlmMalformed, PartialReply) as exc:
                report.failed_calls += 1
                report.errors.append(f"cross-topic pass of {owner.id}: {exc.message}")
                continue
            report.dropped_ops += len(refused)
            report.errors += [f"cross-topic pass of {owner.id}: refused {r}" for r in refused]
            known = await self._vectors_of(list(schemas))
            seen = list(known.values())
            vectors = await self._embed_texts([text for text, _ in patterns])
            ops: list[store_pb2.Op] = []
            for (text, picked), vector in zip(patterns, vectors, strict=True):
                if max(float(v @ vector) for v in seen) >= SCHEMA_DUPLICATE:
                    report.errors.append(f"cross-topic pattern {text[:60]!r} repeats a schema")
                    continue
                seen.append(vector)
                evidence = list(dict.fromkeys(f for i in picked for f in schemas[i].source_ids))
                ops.append(
                    store_pb2.Op(
                        insert=store_pb2.NewMemory(
                            owner=common_pb2.Owner(user_id=owner.id),
                            layer=common_pb2.L6_SCHEMA,
                            content=text,
                            source_ids=evidence,
                            metadata_json=json.dumps(
                                {"cross_topic": True, "schemas": [schemas[i].id for i in picked]}
                            ),
                            pass_id=report.pass_id,
                        )
                    )
                )
            owner.meta["cross_at"] = now
            ops.append(state_op(owner_key(owner.id), owner.meta))
            try:
                await self.store.apply(owner.scope, ops, ACTOR, "cross-topic schemas")
            except ServiceError as exc:
                report.errors.append(f"cross-topic pass of {owner.id}: {exc.message}")
                continue
            report.cross_schemas += len(ops) - 1

    async def _retain_raw(self, report: Report) -> None:
        """Deletes raw rows older than the retention that no live row or edge cites."""
        if self.config.raw_retention_s is None:
            return
        everyone = common_pb2.Scope(all_users=True)
        cutoff = time.time() - self.config.raw_retention_s
        old = await self.store.all_rows(
            store_pb2.ListMemoriesRequest(
                scope=everyone,
                layers=[common_pb2.L2_RAW],
                include_superseded=True,
                created_before=cutoff,
            )
        )
        if not old:
            return
        cited: set[str] = set()
        for row in await self.store.all_rows(
            store_pb2.ListMemoriesRequest(scope=everyone, exclude_layers=[common_pb2.L2_RAW])
        ):
            cited.update(row.source_ids)
        for edge in await self.store.edges(everyone, include_stale=True):
            cited.update(edge.source_ids)
        doomed = [r.id for r in old if r.id not in cited]
        report.protected_raw += len(old) - len(doomed)
        for start in range(0, len(doomed), 500):
            chunk = doomed[start : start + 500]
            await self.store.apply(
                everyone,
                [store_pb2.Op(delete=store_pb2.DeleteOp(id=i)) for i in chunk],
                ACTOR,
                "raw retention",
            )
            report.pruned_raw += len(chunk)

    # -- undo -----------------------------------------------------------------------------

    async def revert(self, pass_id: str, actor: str) -> store_pb2.UndoPassResponse:
        """Reverts a pass; its clusters get their old members back and are not due again."""
        async with self._lock:
            undone = await self.store.undo_pass(pass_id, actor or "api")
            prefix = f"{STATE}pass/{pass_id}/"
            records = await self.store.state(prefix)
            clusters = await self.store.state(f"{STATE}cluster/")
            ops: list[store_pb2.Op] = []
            for key, value in records.items():
                owner, cluster_id = key[len(prefix) :].rsplit("/", 1)
                record = json.loads(value)
                stored = clusters.get(cluster_key(owner, int(cluster_id)))
                if stored is None:
                    continue
                cluster = Cluster.from_json(json.loads(stored))
                gone = set(record["inserted"])
                cluster.members = [m for m in cluster.members if m not in gone]
                cluster.members += [m for m in record["retired"] if m not in cluster.members]
                cluster.done = cluster.hash
                ops.append(state_op(cluster_key(owner, int(cluster_id)), cluster.to_json()))
            if ops:
                await self.store.apply(common_pb2.Scope(all_users=True), ops, ACTOR, "undo")
            return undone


def owner_scope(owner: str) -> common_pb2.Scope:
    """The scope of one person."""
    return common_pb2.Scope(user_id=owner)


def _retire(memory_id: str, how: str, by: str, reason: str, pass_id: str) -> store_pb2.Op:
    op = retire_op(memory_id, how, by, reason)
    op.retire.pass_id = pass_id
    return op
