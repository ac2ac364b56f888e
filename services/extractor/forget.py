"""Forgetting: retire the rows that hold a value and tombstone it on their evidence."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from services.extractor.extract import Embedder
from shared.errors import InvalidArgument, NotFound
from shared.pb import common_pb2, store_pb2
from shared.store_client import StoreClient, retire_op, update_op
from shared.text import value_key
from shared.tombstones import with_tombstones

# A row this similar to the forgotten text holds the same value (near-exact match).
NEAR_EXACT = 0.95
CANDIDATES = 100


@dataclass(frozen=True)
class Forgotten:
    """What a forget retired and where it left tombstones."""

    memories: list[common_pb2.Memory]
    evidence_ids: list[str]


class Forgetting:
    """Retires matching rows as forgotten, with a reason, an origin and tombstones."""

    def __init__(self, store: StoreClient, embedder: Embedder) -> None:
        self.store = store
        self.embedder = embedder

    async def forget(
        self,
        scope: common_pb2.Scope,
        *,
        text: str = "",
        memory_id: str = "",
        reason: str = "",
        origin: str = "",
        memory_tool: bool = False,
    ) -> Forgotten:
        """Retires every live row in scope holding the value; NotFound for an unknown id."""
        if bool(text.strip()) == bool(memory_id):
            raise InvalidArgument("forget needs exactly one of text and id")
        if memory_id:
            row = await self.store.get(scope, memory_id)
            if row.status != "active":
                return Forgotten([], [])
            text = row.content
            matches = {row.id: row}
        else:
            matches = {}
        key = value_key(text)
        if not key:
            raise InvalidArgument("text has nothing to match")
        vectors, model_id = await self.embedder.embed([text])
        hits = await self.store.vector_search(scope, vectors[0], model_id, [], CANDIDATES, 0.5)
        for hit in hits:
            memory = hit.memory
            if memory.status != "active":
                continue
            if value_key(memory.content) == key or hit.score >= NEAR_EXACT:
                matches.setdefault(memory.id, memory)
        matches = _without_evidence(matches, key)
        if memory_tool:
            matches.update(await self._memory_tool_entries(scope, key))
        if not matches:
            return Forgotten([], [])

        evidence: dict[str, None] = {}
        for memory in matches.values():
            if memory.layer == common_pb2.L2_RAW:
                evidence[memory.id] = None
            for source in memory.source_ids:
                evidence[source] = None
        values = sorted({key, *(value_key(m.content) for m in matches.values())} - {""})
        why = reason or "forgotten on request"
        ops = [retire_op(memory.id, "forgotten", "", why) for memory in matches.values()]
        now = time.time()
        tombstoned: list[str] = []
        for raw_id in evidence:
            try:
                raw = await self.store.get(scope, raw_id)
            except NotFound:
                continue  # deleted evidence cannot be re-extracted anyway
            if raw.layer != common_pb2.L2_RAW:
                continue
            stoned = with_tombstones(raw.metadata_json, values, now)
            ops.append(update_op(raw_id, metadata_json=stoned))
            tombstoned.append(raw_id)
        # The caller is the API; the store decides from origin whether the plugin asked.
        applied = await self.store.apply(scope, ops, "api", f"forget: {why}"[:500], origin)
        return Forgotten(applied[: len(matches)], tombstoned)


    async def _memory_tool_entries(
        self, scope: common_pb2.Scope, key: str
    ) -> dict[str, common_pb2.Memory]:
        """Live memory-tool raw rows whose text contains key, and the rows extracted from them."""
        raws = await self.store.all_rows(
            store_pb2.ListMemoriesRequest(scope=scope, layers=[common_pb2.L2_RAW])
        )
        entries = {
            r.id: r for r in raws if _from_memory_tool(r) and key in value_key(r.content)
        }
        if not entries:
            return {}
        derived = await self.store.all_rows(
            store_pb2.ListMemoriesRequest(
                scope=scope,
                layers=[common_pb2.L1_PROFILE, common_pb2.L3_FACT, common_pb2.L7_INTENTION],
            )
        )
        for row in derived:
            if entries.keys() & set(row.source_ids):
                entries[row.id] = row
        return entries


def _without_evidence(
    matches: dict[str, common_pb2.Memory], key: str
) -> dict[str, common_pb2.Memory]:
    """The matches but the turns that only cite the value: a fact is also a key of the turns it
    was learnt from, so they match its text; they are its evidence, tombstoned, not retired."""
    cited = {source for memory in matches.values() for source in memory.source_ids}
    return {
        memory_id: memory
        for memory_id, memory in matches.items()
        if not (
            memory_id in cited
            and memory.layer == common_pb2.L2_RAW
            and value_key(memory.content) != key
        )
    }


def _from_memory_tool(raw: common_pb2.Memory) -> bool:
    try:
        meta = json.loads(raw.metadata_json or "{}")
    except ValueError:
        return False
    return isinstance(meta, dict) and meta.get("write_origin") == "memory_tool"
