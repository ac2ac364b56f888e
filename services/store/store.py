"""The store's rules: scoping, validation, transactional changes and searches."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from services.store import retrieval
from services.store.core import Core, Embedder, VectorModel
from services.store.index import IndexChanges, VectorIndexes
from services.store.keys import (
    CONTEXT_LAYERS,
    NEIGHBOUR_GAP_S,
    context_text,
    own_keys,
)
from services.store.mirrors import ERASED, FactChange, Mirrors, is_preference_fact
from services.store.model import (
    ACTIVE,
    KILLS_DERIVED,
    LAYERS,
    RETIRED,
    AuditEntry,
    CountQuery,
    Delete,
    Edge,
    EndEdge,
    Insert,
    KeywordResult,
    ListQuery,
    MemoryRow,
    Op,
    PutEdge,
    Reach,
    Restore,
    Retire,
    Scored,
    SetState,
    Stats,
    Undone,
    Update,
)
from services.store.repo import Repo, Tx
from services.store.retrieval import EXACT_UP_TO
from services.store.validate import (
    MAX_LIMIT,
    check_ids,
    check_layers,
    page_offset,
    page_size,
    resolved,
    validated,
)
from shared.errors import Conflict, InvalidArgument, NotFound
from shared.layers import EXPERIENCE
from shared.pages import mark_lines, page_text_of

log = logging.getLogger(__name__)

DEFAULT_ACTOR = "api"


def _fact_changes(op: Op, before: MemoryRow, after: MemoryRow | None) -> list[FactChange]:
    """What a retire, restore or update did to the preference facts the profile mirrors."""
    was = is_preference_fact(before) and before.status == ACTIVE
    now_is = is_preference_fact(after) and after is not None and after.status == ACTIVE
    if isinstance(op, Retire) and was:
        return [FactChange(before, False, op.superseded_how, op.superseded_by, op.drop_reason)]
    if isinstance(op, Restore) and now_is and after is not None:
        return [FactChange(after, True)]
    if not isinstance(op, Update) or after is None or (was and now_is and op.content is None):
        return []
    gone = [FactChange(before, False, "updated", after.id)] if was else []
    return gone + ([FactChange(after, True)] if now_is else [])


class Store:
    """Every operation of the Store service, with no transport in sight."""

    def __init__(
        self,
        repo: Repo,
        indexes: VectorIndexes | None,
        embedder: Embedder,
        model: VectorModel,
        alias_group: Callable[[str], tuple[str, ...]],
        data_dir: Path,
        exact_up_to: int = EXACT_UP_TO,
    ) -> None:
        self._core = Core(repo, indexes, embedder, model, alias_group, exact_up_to)
        self._repo = repo
        self._indexes = indexes
        self.model = model
        self._data_dir = data_dir
        self._write_lock = self._core.write_lock

    def reach(self, user_id: str, agent_id: str = "", all_users: bool = False) -> Reach:
        """The owners a scope reaches: the user's alias group (or everyone), maybe one agent."""
        return self._core.reach(user_id, agent_id, all_users)

    # -- writes ---------------------------------------------------------------------------

    async def apply(
        self, reach: Reach, ops: Sequence[Op], actor: str = "", reason: str = ""
    ) -> list[MemoryRow | None]:
        """Applies ops in one transaction: every one of them, or none (None for a delete)."""
        actor = actor or DEFAULT_ACTOR
        ops = validated(reach, ops)
        ids = {
            i: op.id or str(uuid.uuid4()) for i, op in enumerate(ops) if isinstance(op, Insert)
        }
        ops = resolved(ops, ids)
        # Each new text is embedded with the clause keys it is also found by, in one call.
        # A text whose vector came with its op is not embedded again.
        texts: list[str] = []
        for op in ops:
            if isinstance(op, Insert | Update) and op.content is not None:
                if not (isinstance(op, Insert) and op.vector):
                    texts.append(op.content)
                texts.extend(key.text for key in own_keys(op.content))
        vectors = await self._core.embed(texts) if texts else np.zeros((0, self.model.ndim))
        changes = IndexChanges()
        results: list[MemoryRow | None] = []
        pages: set[str] = set()
        facts_changed: list[FactChange] = []
        restating: list[tuple[MemoryRow, np.ndarray, float]] = []
        async with self._write_lock:
            now = time.time()
            next_vector = iter(vectors)
            async with self._repo.transaction() as tx:
                for i, op in enumerate(ops):
                    where = f"op {i}"
                    if isinstance(op, Insert):
                        if op.id and await tx.get(op.id) is not None:
                            raise Conflict(f"{where}: memory {op.id!r} already exists")
                        row = self._new_row(ids[i], op, now)
                        vector = self._given_vector(op, where) if op.vector else next(next_vector)
                        key = await tx.insert(row, vector)
                        changes.add(row.user_id, key, vector)
                        await self._add_keys(tx, row, next_vector, changes)
                        await tx.audit(
                            actor=actor, action="insert", row=row, before=None, after=row,
                            reason=reason, at=now,
                        )
                        if op.pass_id:
                            await tx.record_pass_change(op.pass_id, "insert", row.id)
                        if is_preference_fact(row):
                            facts_changed.append(FactChange(row, live=True))
                        if op.restates_at > 0:
                            restating.append((row, vector, op.restates_at))
                        results.append(row)
                        continue
                    if isinstance(op, SetState):
                        await tx.set_state(op.key, op.value_json, now)
                        results.append(None)
                        continue
                    if isinstance(op, PutEdge):
                        await self._put_edge(tx, reach, op, now, where)
                        results.append(None)
                        continue
                    if isinstance(op, EndEdge):
                        await self._end_edge(tx, reach, op, now, where)
                        results.append(None)
                        continue
                    before = await self._target(tx, reach, op.id)
                    if isinstance(op, Delete):
                        for clause_key in await tx.clause_keys(op.id):
                            changes.remove(before.user_id, clause_key)
                        changes.remove(before.user_id, await tx.delete(op.id))
                        await tx.audit(
                            actor=actor, action="delete", row=before, before=before, after=None,
                            reason=reason, at=now,
                        )
                        pages |= await self._retire_derived(tx, op.id, actor, now)
                        if is_preference_fact(before):
                            facts_changed.append(FactChange(before, live=False, how=ERASED))
                        results.append(None)
                        continue
                    fields: dict[str, Any] = {"updated_at": now}
                    if isinstance(op, Retire):
                        action = "retire"
                        if op.superseded_by:
                            if op.superseded_by == op.id:
                                raise InvalidArgument(f"{where}: a memory cannot supersede itself")
                            await self._target(tx, reach, op.superseded_by)
                        fields.update(
                            status=RETIRED,
                            invalid_at=now,
                            superseded_by=op.superseded_by,
                            superseded_how=op.superseded_how,
                            drop_reason=op.drop_reason,
                            retired_by=actor,
                        )
                        if op.pass_id:
                            fields["pass_id"] = op.pass_id
                    elif isinstance(op, Restore):
                        if before.status == ACTIVE:
                            raise Conflict(f"{where}: memory {op.id!r} is not retired")
                        action = "restore"
                        fields.update(
                            status=ACTIVE,
                            invalid_at=None,
                            superseded_by="",
                            superseded_how="",
                            drop_reason="",
                            retired_by="",
                        )
                    else:
                        action = "update"
                        fields.update(self._update_fields(op))
                        if op.hits_delta:
                            fields["hits"] = before.hits + op.hits_delta
                        if op.content is not None:
                            fields["model_id"] = self.model.model_id
                            await self._new_content(
                                tx, before, op.content, next_vector, changes, now
                            )
                    await tx.update(op.id, fields)
                    after = await tx.get(op.id)
                    await tx.audit(
                        actor=actor, action=action, row=before, before=before, after=after,
                        reason=reason, at=now,
                    )
                    if isinstance(op, Retire):
                        if op.pass_id:
                            await tx.record_pass_change(op.pass_id, "retire", op.id)
                        if op.superseded_how in KILLS_DERIVED or not op.superseded_how:
                            pages |= await self._retire_derived(tx, op.id, actor, now)
                    elif isinstance(op, Restore):
                        pages |= await self._restore_derived(tx, op.id, actor, now)
                    facts_changed += _fact_changes(op, before, after)
                    results.append(after)
                spared = {op.id for op in ops if isinstance(op, Retire)} | set(ids.values())
                for row, vector, at in restating:
                    facts_changed += await self._restate(tx, row, vector, at, spared, actor, now)
                await Mirrors(tx, actor, now, changes).follow(facts_changed)
                await self._render_pages(tx, pages, actor, now, changes)
            if self._indexes is not None:
                await self._indexes.apply(changes)
        return results

    async def _restate(
        self, tx: Tx, new: MemoryRow, vector: np.ndarray, at: float, spared: set[str],
        actor: str, now: float,
    ) -> list[FactChange]:
        """The restatement rule: the owner's live fact nearest to a new one, at cosine >= at,
        is retired as restated by it (experiences never; nor rows this Apply names itself)."""
        if new.layer != "l3_fact" or new.label == EXPERIENCE:
            return []
        reach = self.reach(new.user_id, new.agent_id)
        hits = await self.vector_search(
            reach, vector.tolist(), self.model.model_id, ["l3_fact"], 1, at
        )
        old = await tx.get(hits[0].memory.id) if hits else None
        if old is None or old.id in spared or old.status != ACTIVE or old.label == EXPERIENCE:
            return []
        await tx.update(old.id, {
            "updated_at": now, "status": RETIRED, "invalid_at": now, "superseded_by": new.id,
            "superseded_how": "restated", "drop_reason": "", "retired_by": actor,
        })
        await tx.audit(actor=actor, action="retire", row=old, before=old,
                       after=await tx.get(old.id), reason=f"restated by {new.id}", at=now)
        return [FactChange(old, False, "restated", new.id)] if is_preference_fact(old) else []

    async def _mark_pages(self, tx: Tx, memory_id: str, actor: str, now: float) -> set[str]:
        """Marks the entity page lines memory_id fed stale while any fact behind them is dead.

        Returns the pages whose marks changed; their text is rendered again after the commit.
        """
        touched: set[str] = set()
        for page in await tx.pages_citing(memory_id):
            meta = json.loads(page.metadata_json or "{}")
            lines = [meta, *(h for h in meta.get("history", []) if isinstance(h, dict))]
            cited = {
                f for line in lines if memory_id in (line.get("facts") or []) for f in line["facts"]
            }
            dead: set[str] = set()
            for fact_id in cited:
                fact = await tx.get(fact_id)
                if fact is None or (
                    fact.status == RETIRED
                    and (fact.superseded_how in KILLS_DERIVED or not fact.superseded_how)
                ):
                    dead.add(fact_id)
            if not mark_lines(meta, memory_id, dead):
                continue
            after = json.dumps(meta, ensure_ascii=False, separators=(",", ":"))
            await tx.update(page.id, {"updated_at": now, "metadata": after})
            await tx.audit(
                actor=actor, action="update", row=page, before=page, after=await tx.get(page.id),
                reason=f"page lines fed by {memory_id} marked", at=now,
            )
            touched.add(page.id)
        return touched

    async def _render_pages(
        self, tx: Tx, pages: set[str], actor: str, now: float, changes: IndexChanges
    ) -> None:
        """Renders each page again from its metadata, leaving out its stale lines, in the same
        transaction as the change that marked them (the new text is embedded here)."""
        for page_id in sorted(pages):
            page = await tx.get(page_id)
            if page is None:
                continue
            text = page_text_of(json.loads(page.metadata_json or "{}"))
            if text == page.content:
                continue
            vectors = iter(await self._core.embed([text, *(k.text for k in own_keys(text))]))
            await self._new_content(tx, page, text, vectors, changes, now)
            await tx.update(page_id, {"content": text, "model_id": self.model.model_id,
                                      "updated_at": now})
            await tx.audit(actor=actor, action="update", row=page, before=page,
                           after=await tx.get(page_id), reason="page re-rendered", at=now)

    async def _new_content(
        self, tx: Tx, before: MemoryRow, content: str, vectors: Iterator[np.ndarray],
        changes: IndexChanges, now: float,
    ) -> None:
        """A row's new text takes the next vectors: its own, then its clause keys'."""
        vector = next(vectors)
        old, new = await tx.replace_vector(before.id, self.model.model_id, vector)
        changes.remove(before.user_id, old)
        changes.add(before.user_id, new, vector)
        for clause_key in await tx.drop_clause_keys(before.id):
            changes.remove(before.user_id, clause_key)
        row = replace(before, content=content, created_at=now)
        await self._add_keys(tx, row, vectors, changes, neighbour=False)

    async def _retire_derived(self, tx: Tx, memory_id: str, actor: str, now: float) -> set[str]:
        """Retires as stale the live L5/L6 rows resting on memory_id, and hides their edges.

        Also marks the entity page lines memory_id fed; returns those pages.
        """
        pages = await self._mark_pages(tx, memory_id, actor, now)
        for row in await tx.derived_from(memory_id):
            if row.status != ACTIVE:
                continue
            await tx.update(
                row.id,
                {
                    "updated_at": now, "status": RETIRED, "invalid_at": now,
                    "superseded_by": "", "superseded_how": "stale",
                    "drop_reason": f"evidence {memory_id} was retired", "retired_by": actor,
                },
            )
            after = await tx.get(row.id)
            await tx.audit(
                actor=actor, action="retire", row=row, before=row, after=after,
                reason=f"evidence {memory_id} was retired", at=now,
            )
            for edge in await tx.edges_of_memories([row.id]):
                await tx.update_edge(edge.id, stale=1)
        return pages

    async def _restore_derived(self, tx: Tx, memory_id: str, actor: str, now: float) -> set[str]:
        """Restores the stale rows resting on memory_id once all their evidence is live again.

        Also clears the stale mark of page lines whose facts are all live; returns those pages.
        """
        pages = await self._mark_pages(tx, memory_id, actor, now)
        for row in await tx.derived_from(memory_id):
            if row.status != RETIRED or row.superseded_how != "stale":
                continue
            evidence = [await tx.get(source) for source in row.source_ids]
            if any(e is None or (e.status == RETIRED and e.superseded_how in KILLS_DERIVED)
                   for e in evidence):
                continue
            await tx.update(
                row.id,
                {
                    "updated_at": now, "status": ACTIVE, "invalid_at": None,
                    "superseded_by": "", "superseded_how": "", "drop_reason": "",
                    "retired_by": "",
                },
            )
            after = await tx.get(row.id)
            await tx.audit(
                actor=actor, action="restore", row=row, before=row, after=after,
                reason=f"evidence {memory_id} was restored", at=now,
            )
            for edge in await tx.edges_of_memories([row.id]):
                await tx.update_edge(edge.id, stale=0)
        return pages

    async def _put_edge(
        self, tx: Tx, reach: Reach, op: PutEdge, now: float, where: str
    ) -> None:
        triple = (op.subject, op.relation, op.object)
        if op.memory_id:
            await self._target(tx, reach, op.memory_id)
        existing = await tx.live_edge(op.user_id, op.agent_id, triple)
        if existing is not None:
            sources = tuple(dict.fromkeys((*existing.source_ids, *op.source_ids)))
            facts = tuple(dict.fromkeys((*existing.fact_ids, *op.fact_ids)))
            if sources != existing.source_ids or facts != existing.fact_ids:
                await tx.update_edge(existing.id, source_ids=sources, fact_ids=facts)
                if op.pass_id:
                    before = json.dumps(
                        {"source_ids": existing.source_ids, "fact_ids": existing.fact_ids}
                    )
                    await tx.record_pass_change(op.pass_id, "edge_evidence", existing.id, before)
            return
        if len(set(op.source_ids)) < 2:
            raise InvalidArgument(
                f"{where}: a new edge needs at least two distinct evidence turns"
            )
        edge = Edge(
            id=str(uuid.uuid4()),
            user_id=op.user_id,
            agent_id=op.agent_id,
            subject=op.subject,
            relation=op.relation,
            object=op.object,
            weight=op.weight or 1.0,
            source_ids=tuple(dict.fromkeys(op.source_ids)),
            fact_ids=tuple(dict.fromkeys(op.fact_ids)),
            memory_id=op.memory_id,
            recorded_at=now,
            invalidated_at=None,
            valid_from=op.valid_from,
            valid_to=op.valid_to,
            stale=False,
            pass_id=op.pass_id,
        )
        await tx.insert_edge(edge)
        if op.pass_id:
            await tx.record_pass_change(op.pass_id, "edge_new", edge.id)

    async def _end_edge(self, tx: Tx, reach: Reach, op: EndEdge, now: float, where: str) -> None:
        edge = await tx.get_edge(op.id)
        if edge is None or not reach.contains(edge.user_id, edge.agent_id):
            raise NotFound(f"{where}: edge {op.id!r} not found")
        if edge.invalidated_at is not None:
            return
        await tx.update_edge(
            edge.id, invalidated_at=now, valid_to=op.valid_to if op.valid_to else now
        )
        if op.pass_id:
            before = json.dumps({"valid_to": edge.valid_to, "invalidated_at": None})
            await tx.record_pass_change(op.pass_id, "edge_end", edge.id, before)

    async def undo_pass(self, pass_id: str, actor: str = "") -> Undone:
        """Reverts every change a consolidation pass made, newest first, in one transaction."""
        if not pass_id:
            raise InvalidArgument("pass_id is required")
        actor = actor or DEFAULT_ACTOR
        undone = Undone()
        why = f"undo of pass {pass_id}"
        pages: set[str] = set()
        facts_changed: list[FactChange] = []
        index_changes = IndexChanges()
        async with self._write_lock:
            now = time.time()
            async with self._repo.transaction() as tx:
                changes = await tx.pass_changes(pass_id)
                if not changes:
                    raise NotFound(f"pass {pass_id!r} not found (or it changed nothing)")
                for kind, target, before_json in changes:
                    if kind in ("insert", "retire"):
                        row = await tx.get(target)
                        if row is None:
                            continue
                        if kind == "insert" and row.status == ACTIVE:
                            fields = {
                                "updated_at": now, "status": RETIRED, "invalid_at": now,
                                "superseded_by": "", "superseded_how": "undone",
                                "drop_reason": why, "retired_by": actor,
                            }
                            action = "retire"
                            undone.undone_ids.append(target)
                        elif kind == "retire" and row.status == RETIRED and row.pass_id == pass_id:
                            fields = {
                                "updated_at": now, "status": ACTIVE, "invalid_at": None,
                                "superseded_by": "", "superseded_how": "", "drop_reason": "",
                                "retired_by": "",
                            }
                            action = "restore"
                            undone.restored_ids.append(target)
                        else:
                            continue
                        await tx.update(target, fields)
                        await tx.audit(
                            actor=actor, action=action, row=row, before=row,
                            after=await tx.get(target), reason=why, at=now,
                        )
                        if action == "retire":
                            pages |= await self._retire_derived(tx, target, actor, now)
                            for edge in await tx.edges_of_memories([target]):
                                await tx.update_edge(edge.id, undone=1)
                        else:
                            pages |= await self._restore_derived(tx, target, actor, now)
                        if is_preference_fact(row):
                            facts_changed.append(FactChange(row, action == "restore", "undone"))
                        continue
                    if await tx.get_edge(target) is None:
                        continue
                    undone.edge_ids.append(target)
                    if kind == "edge_new":
                        await tx.update_edge(target, undone=1)
                    elif kind == "edge_evidence":
                        before = json.loads(before_json)
                        await tx.update_edge(
                            target, source_ids=before["source_ids"], fact_ids=before["fact_ids"]
                        )
                    elif kind == "edge_end":
                        before = json.loads(before_json)
                        await tx.update_edge(
                            target, valid_to=before["valid_to"], invalidated_at=None
                        )
                await Mirrors(tx, actor, now, index_changes).follow(facts_changed)
                await self._render_pages(tx, pages, actor, now, index_changes)
            if self._indexes is not None:
                await self._indexes.apply(index_changes)
        return undone

    async def _add_keys(
        self,
        tx: Tx,
        row: MemoryRow,
        next_vector: Iterator[np.ndarray],
        changes: IndexChanges,
        neighbour: bool = True,
    ) -> None:
        """Writes a row's extra keys: its clauses, and for a turn its place in the talk."""
        for key in own_keys(row.content):
            vector = next(next_vector)
            changes.add(
                row.user_id,
                await tx.add_clause_key(row.id, key.kind, key.text, self.model.model_id, vector),
                vector,
            )
        if row.layer not in CONTEXT_LAYERS:
            return
        previous = await tx.previous_turn(row, row.created_at - NEIGHBOUR_GAP_S)
        before = previous[1] if previous is not None else None
        await tx.set_context_key(row.id, context_text(before, row.content, None))
        if previous is not None and neighbour:
            # The turn before now has a turn after: its key grows by this one.
            prior = await tx.context_key(previous[0])
            await tx.set_context_key(
                previous[0], context_text(None, prior or previous[1], row.content)
            )

    async def _target(self, tx: Tx, reach: Reach, memory_id: str) -> MemoryRow:
        row = await tx.get(memory_id)
        if row is None or not reach.contains(row.user_id, row.agent_id):
            raise NotFound(f"memory {memory_id!r} not found")
        return row

    def _given_vector(self, op: Insert, where: str) -> np.ndarray:
        """The vector an insert brought, checked against the store's model, unit length."""
        if op.vector_model_id != self.model.model_id:
            raise InvalidArgument(
                f"{where}: the vector comes from model {op.vector_model_id!r} but the store "
                f"holds {self.model.model_id!r} vectors"
            )
        vector = np.asarray(op.vector, dtype=np.float32)
        norm = float(np.linalg.norm(vector))
        if vector.shape != (self.model.ndim,) or not np.isfinite(norm) or norm == 0.0:
            raise InvalidArgument(f"{where}: the vector must be {self.model.ndim} finite numbers")
        return vector / norm

    def _new_row(self, memory_id: str, op: Insert, now: float) -> MemoryRow:
        return MemoryRow(
            id=memory_id,
            user_id=op.user_id,
            agent_id=op.agent_id,
            session_id=op.session_id,
            layer=op.layer,
            content=op.content,
            label=op.label,
            count=op.count,
            source_ids=op.source_ids,
            metadata_json=op.metadata_json,
            model_id=self.model.model_id,
            created_at=now,
            updated_at=now,
            event_at=op.event_at,
            valid_to=op.valid_to,
            due_at=op.due_at,
            extraction_status=op.extraction_status,
            write_mode=op.write_mode,
            pass_id=op.pass_id,
        )

    @staticmethod
    def _update_fields(op: Update) -> dict[str, Any]:
        fields = {
            "content": op.content,
            "extraction_status": op.extraction_status,
            "extraction_tries": op.extraction_tries,
            "count": op.count,
            "hits": op.hits,
            "metadata": op.metadata_json,
            "event_at": op.event_at,
            "valid_to": op.valid_to,
            "due_at": op.due_at,
            "label": op.label,
        }
        return {name: value for name, value in fields.items() if value is not None}

    async def delete_many(self, reach: Reach, layers: Sequence[str], actor: str = "") -> int:
        """Erases every row (live or retired) inside a reach and layers; returns how many."""
        check_layers(layers)
        actor = actor or DEFAULT_ACTOR
        changes = IndexChanges()
        async with self._write_lock:
            now = time.time()
            async with self._repo.transaction() as tx:
                rows = await tx.rows_in(reach, layers)
                for row in rows:
                    changes.remove(row.user_id, await tx.delete(row.id))
                    await tx.audit(
                        actor=actor, action="delete", row=row, before=row, after=None,
                        reason="delete_all", at=now,
                    )
            if self._indexes is not None:
                await self._indexes.apply(changes)
        return len(rows)

    # -- reads ----------------------------------------------------------------------------

    async def get(self, reach: Reach, memory_id: str) -> MemoryRow:
        """One row, if the reach owns it."""
        return await self._core.get(reach, memory_id)

    async def stored_vector(self, memory_id: str) -> list[float]:
        """A row's stored vector of the store's model (empty when it has none)."""
        found = await self._repo.memory_vectors([memory_id], self.model.model_id)
        return found[memory_id].tolist() if memory_id in found else []

    async def list_rows(self, reach: Reach, query: ListQuery) -> tuple[list[MemoryRow], int]:
        """A page of rows inside the reach, and the total that match."""
        check_layers(query.layers)
        check_layers(query.exclude_layers)
        query = replace(query, limit=page_size(query.limit), offset=page_offset(query.offset))
        return await self._repo.list_rows(reach, query)

    async def get_many(
        self, reach: Reach, memory_ids: Sequence[str]
    ) -> tuple[list[MemoryRow], list[str]]:
        """The rows the reach owns, in the order asked (each once), and the ids it does not."""
        ids = list(dict.fromkeys(memory_ids))
        check_ids(ids)
        found = await self._repo.get_many(reach, ids)
        return [found[i] for i in ids if i in found], [i for i in ids if i not in found]

    async def count(self, reach: Reach, query: CountQuery) -> list[int]:
        """Rows created in each bucket of time the query names."""
        check_layers(query.layers)
        check_layers(query.exclude_layers)
        if not 1 <= query.buckets <= MAX_LIMIT:
            raise InvalidArgument(f"buckets must be between 1 and {MAX_LIMIT}")
        if not query.bucket_s > 0:
            raise InvalidArgument("bucket_s must be positive")
        return await self._repo.count_buckets(reach, query)

    async def keyword_search(
        self,
        reach: Reach,
        query: str,
        layers: Sequence[str] = (),
        k: int = 0,
        include_superseded: bool = False,
        min_terms: int = 0,
        context_keys: bool = False,
    ) -> KeywordResult:
        """Rows containing enough of the query's terms, best bm25 first (see retrieval)."""
        return await retrieval.keyword_search(
            self._repo, reach, query, layers, k, include_superseded, min_terms, context_keys
        )

    async def vector_search(
        self,
        reach: Reach,
        vector: Sequence[float],
        model_id: str,
        layers: Sequence[str] = (),
        k: int = 0,
        min_score: float = 0.0,
        include_superseded: bool = False,
    ) -> list[Scored]:
        """The k rows in reach most similar to vector (cosine), none below min_score."""
        return await retrieval.vector_search(
            self._core, reach, vector, model_id, layers, k, min_score, include_superseded
        )

    async def stats(self, reach: Reach) -> Stats:
        """Row counts in a reach and the store's model."""
        live, retired, unextracted, vectors = await self._repo.counts(reach)
        nodes, edges = await self._repo.graph_counts(reach)
        return Stats(
            layers={layer: live.get(layer, 0) for layer in LAYERS},
            total=sum(live.values()),
            unextracted=unextracted,
            retired=retired,
            db_bytes=self._repo.db_bytes(),
            vectors=vectors,
            model_id=self.model.model_id,
            ndim=self.model.ndim,
            data_dir=str(self._data_dir),
            graph_nodes=nodes,
            graph_edges=edges,
        )

    async def list_edges(
        self, reach: Reach, as_of: float | None, include_stale: bool, limit: int, offset: int = 0
    ) -> tuple[list[Edge], int]:
        """A page of a reach's edges: the live graph now, or as it stood at as_of."""
        return await self._repo.list_edges(
            reach, as_of, include_stale, page_size(limit), page_offset(offset)
        )

    async def neighbours(
        self, reach: Reach, memory_ids: Sequence[str], k: int
    ) -> list[tuple[str, str, float]]:
        """Each memory's k nearest among the given ones: (from, to, cosine), nearest first."""
        if k < 0:
            raise InvalidArgument("k must not be negative")
        ids = list(dict.fromkeys(memory_ids))
        check_ids(ids)
        for memory_id in ids:
            await self.get(reach, memory_id)
        vectors = await self._repo.memory_vectors(ids, self.model.model_id)
        kept = [i for i in ids if i in vectors]
        if k == 0 or len(kept) < 2:
            return []
        matrix = np.stack([vectors[i] for i in kept])
        scores = matrix @ matrix.T
        np.fill_diagonal(scores, -np.inf)
        links: list[tuple[str, str, float]] = []
        for a, memory_id in enumerate(kept):
            for b in np.argsort(-scores[a], kind="stable")[: min(k, len(kept) - 1)]:
                links.append((memory_id, kept[b], float(scores[a, b])))
        return links

    async def get_state(self, prefix: str) -> list[tuple[str, str]]:
        """State values under a key prefix."""
        return await self._repo.get_state(prefix)

    async def history(self, reach: Reach, memory_id: str) -> list[AuditEntry]:
        """The audit trail of one row; still there after a delete, for the row's owner."""
        entries = await self._repo.history(memory_id) if memory_id else []
        row = await self._repo.get(memory_id) if memory_id else None
        if row is not None:
            owned = reach.contains(row.user_id, row.agent_id)
        else:
            owned = bool(entries) and reach.contains(entries[-1][1], entries[-1][2])
        if not owned:
            raise NotFound(f"memory {memory_id!r} not found")
        return [entry for entry, _, _ in entries]

    async def flush(self) -> int:
        """Saves the vector indexes now; returns how many vectors they hold."""
        if self._indexes is None:
            return 0
        return await self._indexes.save()
