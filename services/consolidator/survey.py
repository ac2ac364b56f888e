"""The state layout of passes and the survey that brings each owner's clusters up to date.

An owner is a person as one of their agents (or none) holds them: facts of two agents of one
person are never clustered together, so no pass merges one agent's memory into another's scope.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.consolidator.clusters import Cluster, assign, rebuilt
from services.consolidator.config import ConsolidatorConfig
from services.consolidator.vectors import Vectors
from shared.pb import common_pb2, store_pb2
from shared.store_client import GraphStoreClient, state_op

ACTOR = "consolidator"
STATE = "consolidator/"
CLUSTERS = f"{STATE}cluster/"
# Between the user and the agent in an agent's owner name; a person's own name is their user id.
AGENT_MARK = "/agent:"


def cluster_key(owner: str, cluster_id: int) -> str:
    """The state key of one cluster."""
    return f"{CLUSTERS}{owner}/{cluster_id}"


def owner_key(owner: str) -> str:
    """The state key of an owner's schedule (cluster build time, cross-topic pass)."""
    return f"{STATE}owner/{owner}"


def pass_prefix(pass_id: str) -> str:
    """The state prefix under which a pass records what each cluster retired and inserted."""
    return f"{STATE}pass/{pass_id}/"


def pass_key(pass_id: str, owner: str, cluster_id: int) -> str:
    """The state key of one cluster's record in a pass (read by undo)."""
    return f"{pass_prefix(pass_id)}{owner}/{cluster_id}"


def owner_name(user_id: str, agent_id: str) -> str:
    """The name an owner's state keys carry: the user id, with the agent's after AGENT_MARK."""
    return f"{user_id}{AGENT_MARK}{agent_id}" if agent_id else user_id


def owner_scope(user_id: str, agent_id: str = "") -> common_pb2.Scope:
    """The scope of one person, or of one of their agents."""
    return common_pb2.Scope(user_id=user_id, agent_id=agent_id)


@dataclass
class Owner:
    """One person's live facts and topic clusters, as one agent (or none) holds them."""

    user_id: str
    agent_id: str
    facts: dict[str, common_pb2.Memory]
    clusters: list[Cluster]
    meta: dict[str, Any]
    arc_asked: bool = False

    @property
    def id(self) -> str:
        """The owner's name in state keys and reports."""
        return owner_name(self.user_id, self.agent_id)

    @property
    def scope(self) -> common_pb2.Scope:
        """The owner's scope (the store expands the user to the alias group)."""
        return owner_scope(self.user_id, self.agent_id)


UPKEEP_OPS = 1_000
"""The most cluster state ops one Apply carries: the store takes at most 5,000, and an owner
of many facts has a cluster per few of them. A survey cut between two is made up by the next,
which finds the clusters still to save."""


async def survey(
    store: GraphStoreClient,
    vectors: Vectors,
    config: ConsolidatorConfig,
    canonical_user: Callable[[str], str],
    now: float,
) -> list[Owner]:
    """Every owner with live facts, its clusters brought up to date (and saved)."""
    state, facts = await asyncio.gather(
        store.state(STATE),
        store.all_rows(
            store_pb2.ListMemoriesRequest(
                scope=common_pb2.Scope(all_users=True), layers=[common_pb2.L3_FACT], order="oldest"
            )
        ),
    )
    by_owner: dict[str, dict[str, common_pb2.Memory]] = {}
    scopes: dict[str, tuple[str, str]] = {}
    for fact in facts:
        user_id, agent_id = canonical_user(fact.owner.user_id), fact.owner.agent_id
        name = owner_name(user_id, agent_id)
        scopes[name] = (user_id, agent_id)
        by_owner.setdefault(name, {})[fact.id] = fact
    stored = _stored_clusters(state)
    owners: list[Owner] = []
    for owner_id in sorted(set(by_owner) | set(stored)):
        rows = by_owner.get(owner_id, {})
        old = sorted(stored.get(owner_id, []), key=lambda c: c.id)
        meta = json.loads(state.get(owner_key(owner_id), "{}"))
        by_id = await vectors.of_rows(list(rows.values()))
        before = {c.id: c.to_json() for c in old}
        clusters, meta_changed = _clusters_now(old, list(rows), by_id, meta, config, now)
        ops = _upkeep_ops(owner_id, before, clusters, meta if meta_changed else None)
        # Clusters left without facts are state alone, written in any owner's name.
        scope = owner_scope(*scopes[owner_id]) if rows else common_pb2.Scope(all_users=True)
        for start in range(0, len(ops), UPKEEP_OPS):  # the owner's meta, last, goes last
            await store.apply(scope, ops[start : start + UPKEEP_OPS], ACTOR, "clusters")
        if rows:
            owners.append(Owner(*scopes[owner_id], rows, clusters, meta))
    return owners


def _stored_clusters(state: Mapping[str, str]) -> dict[str, list[Cluster]]:
    stored: dict[str, list[Cluster]] = {}
    for key, value in state.items():
        if key.startswith(CLUSTERS):
            owner = key[len(CLUSTERS) :].rsplit("/", 1)[0]
            stored.setdefault(owner, []).append(Cluster.from_json(json.loads(value)))
    return stored


def _clusters_now(
    old: list[Cluster],
    fact_ids: Sequence[str],
    vectors: Mapping[str, np.ndarray],
    meta: dict[str, Any],
    config: ConsolidatorConfig,
    now: float,
) -> tuple[list[Cluster], bool]:
    """The owner's clusters, rebuilt when none exist or they are older than the recluster time.

    Updates meta in place and says whether it changed.
    """
    recluster = config.recluster_s
    if not old or (recluster and now - float(meta.get("built_at", 0)) > recluster):
        clusters = rebuilt(old, fact_ids, vectors, config.batch)
        meta["built_at"] = now
        meta["next"] = len(clusters) + 1
        return clusters, True
    clusters, next_id = assign(
        [Cluster.from_json(c.to_json()) for c in old],
        fact_ids,
        vectors,
        config.batch,
        int(meta.get("next", max((c.id for c in old), default=0) + 1)),
    )
    changed = next_id != meta.get("next")
    meta["next"] = next_id
    return clusters, changed


def _upkeep_ops(
    owner_id: str,
    before: Mapping[int, dict[str, Any]],
    clusters: Sequence[Cluster],
    meta: dict[str, Any] | None,
) -> list[store_pb2.Op]:
    ops = [
        state_op(cluster_key(owner_id, c.id), c.to_json())
        for c in clusters
        if before.get(c.id) != c.to_json()
    ]
    kept = {c.id for c in clusters}
    ops += [state_op(cluster_key(owner_id, i), None) for i in before if i not in kept]
    if meta is not None:
        ops.append(state_op(owner_key(owner_id), meta))
    return ops
