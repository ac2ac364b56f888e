"""Raw retention: old raw turns that nothing live cites and that were extracted are deleted."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from services.consolidator.survey import ACTOR
from shared.layers import DONE
from shared.pb import common_pb2, store_pb2
from shared.store_client import GraphStoreClient

if TYPE_CHECKING:
    from services.consolidator.passes import Report

DELETE_CHUNK = 500


async def retain_raw(store: GraphStoreClient, retention_s: float | None, report: Report) -> None:
    """Deletes raw rows older than the retention that no live row or edge cites and that were
    extracted (deleting one never extracted, still to be or written in lite mode, loses an
    acknowledged write)."""
    if retention_s is None:
        return
    everyone = common_pb2.Scope(all_users=True)
    cutoff = time.time() - retention_s
    old = await store.all_rows(
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
    for row in await store.all_rows(
        store_pb2.ListMemoriesRequest(scope=everyone, exclude_layers=[common_pb2.L2_RAW])
    ):
        cited.update(row.source_ids)
    for edge in await store.edges(everyone, include_stale=True):
        cited.update(edge.source_ids)
    doomed = [r.id for r in old if r.id not in cited and r.extraction_status == DONE]
    report.protected_raw += len(old) - len(doomed)
    for start in range(0, len(doomed), DELETE_CHUNK):
        chunk = doomed[start : start + DELETE_CHUNK]
        await store.apply(
            everyone,
            [store_pb2.Op(delete=store_pb2.DeleteOp(id=i)) for i in chunk],
            ACTOR,
            "raw retention",
        )
        report.pruned_raw += len(chunk)
