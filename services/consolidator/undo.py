"""Undoing a pass: the store reverts its rows, its clusters get their old members back."""

from __future__ import annotations

import asyncio
import json

from services.consolidator.clusters import Cluster
from services.consolidator.survey import ACTOR, CLUSTERS, cluster_key, pass_prefix
from shared.pb import common_pb2, store_pb2
from shared.store_client import GraphStoreClient, state_op


async def revert_pass(
    store: GraphStoreClient, pass_id: str, actor: str
) -> store_pb2.UndoPassResponse:
    """Reverts a pass; its clusters get their old members back and are not due again."""
    undone = await store.undo_pass(pass_id, actor or "api")
    prefix = pass_prefix(pass_id)
    records, clusters = await asyncio.gather(store.state(prefix), store.state(CLUSTERS))
    ops: list[store_pb2.Op] = []
    kept = set(undone.kept_ids)
    for key, value in records.items():
        owner, cluster_id = key[len(prefix) :].rsplit("/", 1)
        record = json.loads(value)
        stored = clusters.get(cluster_key(owner, int(cluster_id)))
        if stored is None:
            continue
        cluster = Cluster.from_json(json.loads(stored))
        gone = set(record["inserted"])
        cluster.members = [m for m in cluster.members if m not in gone]
        back = [m for m in record["retired"] if m not in kept]  # kept ones stay retired
        cluster.members += [m for m in back if m not in cluster.members]
        cluster.done = cluster.hash
        ops.append(state_op(cluster_key(owner, int(cluster_id)), cluster.to_json()))
    if ops:
        await store.apply(common_pb2.Scope(all_users=True), ops, ACTOR, "undo")
    return undone
