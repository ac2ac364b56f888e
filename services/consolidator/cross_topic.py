"""Cross-topic schemas: patterns the model finds across an owner's schemas from several clusters."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from services.consolidator.cluster_ops import repeats_known
from services.consolidator.plan import PartialReply, Pattern, read_patterns
from services.consolidator.prompt import CROSS_SCHEMA, CROSS_SCHEMAS_SHOWN, cross_messages
from services.consolidator.survey import ACTOR, Owner, owner_key
from services.consolidator.vectors import Vectors
from shared.errors import ServiceError
from shared.llm import LlmClient, LlmMalformed, LlmUnavailable
from shared.pb import common_pb2, store_pb2
from shared.store_client import GraphStoreClient, state_op

if TYPE_CHECKING:
    from services.consolidator.passes import Report

LEAST_SCHEMAS = 4
LEAST_TOPICS = 2


async def cross_topic(
    store: GraphStoreClient,
    llm: LlmClient,
    vectors: Vectors,
    every_s: float | None,
    report: Report,
    owners: Sequence[Owner],
    now: float,
) -> None:
    """Asks for each owner's cross-topic patterns when the last ask is every_s old."""
    if every_s is None or not (llm.configured and llm.has_key()):
        return
    for owner in owners:
        if now - float(owner.meta.get("cross_at", 0)) < every_s:
            continue
        schemas = await store.list_rows(
            store_pb2.ListMemoriesRequest(
                scope=owner.scope, layers=[common_pb2.L6_SCHEMA], limit=CROSS_SCHEMAS_SHOWN
            )
        )
        topics = {json.loads(s.metadata_json or "{}").get("cluster") for s in schemas}
        topics.discard(None)
        if len(schemas) < LEAST_SCHEMAS or len(topics) < LEAST_TOPICS:
            continue
        try:
            reply = await llm.json_reply(cross_messages(schemas), CROSS_SCHEMA)
            report.llm_calls += 1
            patterns, refused = read_patterns(reply, len(schemas))
        except (LlmUnavailable, LlmMalformed, PartialReply) as exc:
            report.failed_calls += 1
            report.errors.append(f"cross-topic pass of {owner.id}: {exc.message}")
            continue
        report.dropped_ops += len(refused)
        report.errors += [f"cross-topic pass of {owner.id}: refused {r}" for r in refused]
        known, found = await asyncio.gather(
            vectors.of_rows(list(schemas)), vectors.of_texts([text for text, _ in patterns])
        )
        seen = [(s.content, known[s.id]) for s in schemas]
        ops = _pattern_ops(report, owner, schemas, patterns, seen, found)
        owner.meta["cross_at"] = now
        ops.append(state_op(owner_key(owner.id), owner.meta))
        try:
            await store.apply(owner.scope, ops, ACTOR, "cross-topic schemas")
        except ServiceError as exc:
            report.errors.append(f"cross-topic pass of {owner.id}: {exc.message}")
            continue
        report.cross_schemas += len(ops) - 1


def _pattern_ops(
    report: Report,
    owner: Owner,
    schemas: Sequence[common_pb2.Memory],
    patterns: Sequence[Pattern],
    seen: list[tuple[str, np.ndarray]],
    vectors: np.ndarray,
) -> list[store_pb2.Op]:
    """An L6 row per pattern that repeats no schema, citing its schemas' evidence."""
    ops: list[store_pb2.Op] = []
    for (text, picked), vector in zip(patterns, vectors, strict=True):
        if repeats_known(text, vector, seen):
            report.errors.append(f"cross-topic pattern {text[:60]!r} repeats a schema")
            continue
        seen.append((text, vector))
        evidence = list(dict.fromkeys(f for i in picked for f in schemas[i].source_ids))
        row = store_pb2.NewMemory(
            owner=common_pb2.Owner(user_id=owner.user_id, agent_id=owner.agent_id),
            layer=common_pb2.L6_SCHEMA,
            content=text,
            source_ids=evidence,
            metadata_json=json.dumps(
                {"cross_topic": True, "schemas": [schemas[i].id for i in picked]}
            ),
            pass_id=report.pass_id,
        )
        ops.append(store_pb2.Op(insert=row))
    return ops
