"""The opt-in second call: compare new facts with similar stored ones (UPDATE, SUPERSEDE, LINK)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from services.extractor.prompt import TURN_CLOSE, TURN_OPEN
from shared.llm import LlmClient, ReplySchema, array_of, object_schema
from shared.pb import common_pb2, store_pb2
from shared.store_client import StoreClient, retire_op, update_op

log = logging.getLogger(__name__)

SIMILAR = 0.70
PER_FACT = 5
SYSTEM = """You compare NEW facts, just learned, with similar STORED facts about the same person. \
For each pair that belongs together choose one op:
- UPDATE: the new fact repeats the stored one or adds detail to it (a recurring event counts as \
one series);
- SUPERSEDE: the new fact makes the stored one no longer true;
- LINK: they are related but both stay true.
Leave unrelated pairs out. Refer to facts only by their numbers in [brackets].
Reply with exactly one JSON object: {"ops": [{"op": "UPDATE | SUPERSEDE | LINK", "new": number, \
"old": number}]}"""
# What reconcile reads: a list of ops, each naming a kind and two shown numbers.
RECONCILE_SCHEMA = ReplySchema(
    "reconcile",
    object_schema(
        {
            "ops": array_of(
                object_schema(
                    {
                        "op": {"type": "string", "enum": ["UPDATE", "SUPERSEDE", "LINK"]},
                        "new": {"type": "integer"},
                        "old": {"type": "integer"},
                    }
                )
            )
        }
    ),
)


def _number(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().strip("[]").isdigit():
        return int(value.strip().strip("[]"))
    return None


class Reconciler:
    """Runs the second call and applies its checked ops in one store transaction."""

    def __init__(self, store: StoreClient, llm: LlmClient) -> None:
        self.store = store
        self.llm = llm
        self.dropped = 0

    async def reconcile(
        self,
        scope: common_pb2.Scope,
        turn: str,
        new_facts: Sequence[common_pb2.Memory],
        vectors: Sequence[Any],
        model_id: str,
    ) -> int:
        """Compares new facts with stored ones at >= 0.70; returns how many ops were applied."""
        fresh = {m.id for m in new_facts}
        stored: dict[str, common_pb2.Memory] = {}
        for vector in vectors:
            for hit in await self.store.vector_search(
                scope, vector, model_id, [common_pb2.L3_FACT], PER_FACT + len(fresh), SIMILAR
            ):
                if hit.memory.id not in fresh and hit.memory.label != "task_experience":
                    stored.setdefault(hit.memory.id, hit.memory)
        if not stored:
            return 0
        new_numbers = {i: m for i, m in enumerate(new_facts, start=1)}
        old_numbers = {i: m for i, m in enumerate(stored.values(), start=len(new_facts) + 1)}
        lines = ["New facts:"]
        lines += [f"[{n}] {m.content}" for n, m in new_numbers.items()]
        lines.append("Stored facts:")
        lines += [f"[{n}] {m.content}" for n, m in old_numbers.items()]
        lines.append(f"The turn they came from:\n{TURN_OPEN}\n{turn}\n{TURN_CLOSE}")
        reply = await self.llm.json_reply(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n".join(lines)}],
            RECONCILE_SCHEMA,
        )
        ops: list[store_pb2.Op] = []
        touched: set[str] = set()
        links: dict[str, list[str]] = {}
        raw_ops = reply.get("ops")
        for item in raw_ops if isinstance(raw_ops, list) else []:
            if not isinstance(item, dict):
                continue
            kind = str(item.get("op", "")).upper()
            new_n, old_n = _number(item.get("new")), _number(item.get("old"))
            new = new_numbers.get(new_n) if new_n is not None else None
            old = old_numbers.get(old_n) if old_n is not None else None
            if kind not in ("UPDATE", "SUPERSEDE", "LINK") or new is None or old is None:
                self.dropped += 1
                log.warning("dropped a reconcile op naming numbers that were not shown: %.200r",
                            item)
                continue
            if kind == "LINK":
                links.setdefault(new.id, []).append(old.id)
                continue
            if old.id in touched:
                continue
            touched.add(old.id)
            how = "updated" if kind == "UPDATE" else "replaced"
            ops.append(retire_op(old.id, how, new.id, "reconcile"))
            if kind == "UPDATE":
                ops.append(update_op(new.id, count=max(old.count, 1) + max(new.count, 1)))
        for new_id, old_ids in links.items():
            memory = next(m for m in new_facts if m.id == new_id)
            meta = json.loads(memory.metadata_json or "{}")
            meta["links"] = sorted(set(meta.get("links", [])) | set(old_ids))
            ops.append(update_op(new_id, metadata_json=json.dumps(meta)))
        if ops:
            await self.store.apply(scope, ops, "extractor", "reconcile")
        return len(ops)
