"""The Store facade: every operation of the Store service, each handed to the room that owns it."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from services.store import apply, compact, forget, graph, leases, owners, retrieval, transfer, undo
from services.store.core import Core, Embedder, VectorModel
from services.store.dedupe import Dedupe, dedupe_facts
from services.store.disk_full import full_disk_refused
from services.store.idempotency import IdempotencyKey, Replayed
from services.store.model import (
    LAYERS,
    LINE_IDS_STATE,
    AuditEntry,
    CountQuery,
    Edge,
    KeywordResult,
    ListPage,
    ListQuery,
    MemoryRow,
    Op,
    Reach,
    Scored,
    Stats,
    Undone,
)
from services.store.reembed import ModelSource, Progress, Reembedder, ReembedPlan
from services.store.retrieval import EXACT_UP_TO
from services.store.rows import Rows, Vectors
from services.store.snapshot import Snapshot, SnapshotPlan, Snapshots
from services.store.transfer import Imported
from services.store.transfer_format import LineContext
from services.store.validate import (
    MAX_LIMIT,
    check_ids,
    check_layers,
    check_op_count,
    check_states,
    page_offset,
    page_size,
)
from shared.errors import Conflict, InvalidArgument, NotFound, Unavailable
from shared.grants import Grant


class Store:
    """Every operation of the Store service, with no transport in sight."""

    def __init__(
        self,
        repo: Rows,
        indexes: Vectors | None,
        embedder: Embedder,
        model: VectorModel,
        alias_group: Callable[[str], tuple[str, ...]],
        data_dir: Path,
        exact_up_to: int = EXACT_UP_TO,
        snapshot_plan: SnapshotPlan | None = None,
        location: str = "",
        first_id: Callable[[str], str] = str,
    ) -> None:
        self._core = Core(repo, indexes, embedder, model, alias_group, exact_up_to, first_id)
        self._repo = repo
        self._line_ids_namespace: uuid.UUID | None = None
        # Where the rows are, as stats show it: the data directory, or the database's address.
        self._location = location or str(data_dir)
        self.reembed: Reembedder | None = None
        self.snapshots = (
            Snapshots(self._core, data_dir, snapshot_plan) if snapshot_plan is not None else None
        )

    async def answers(self) -> bool:
        """Whether the store can serve now: its database answers."""
        return await self._repo.answers()

    @property
    def keyword_problem(self) -> str:
        """Why keyword searches miss acknowledged writes now ("" when they do not)."""
        return self._repo.keyword_problem

    @property
    def model(self) -> VectorModel:
        """The model the store's vectors come from (a re-embed changes it when it is done)."""
        return self._core.model

    @property
    def backend(self) -> str:
        """Where the rows are kept: "sqlite" or "postgresql"."""
        return self._core.backend

    def start_reembed(
        self, embedder: ModelSource, folder: Path, target: VectorModel, plan: ReembedPlan
    ) -> Reembedder:
        """The re-embed that moves the store to target (its run() does the work)."""
        self.reembed = Reembedder(self._core, embedder, folder, target, plan)
        return self.reembed

    async def reembed_progress(self) -> Progress | None:
        """Where a re-embed stands (None when the store runs the configured model)."""
        return await self.reembed.progress() if self.reembed is not None else None

    def reach(
        self, user_id: str, agent_id: str = "", all_users: bool = False, grant: Grant | None = None
    ) -> Reach:
        """The owners a scope reaches: the user's alias group (or everyone), maybe one agent;
        with a caller's grant, an owner outside it is refused and everyone is the granted."""
        return self._core.reach(user_id, agent_id, all_users, grant)

    # -- writes ---------------------------------------------------------------------------

    async def apply(
        self,
        reach: Reach,
        ops: Sequence[Op],
        actor: str = "",
        reason: str = "",
        key: IdempotencyKey | None = None,
    ) -> list[MemoryRow | None] | Replayed:
        """Applies ops in one transaction: every one of them, or none (None for a delete); a
        key used before for the same ops gives that write's answer instead."""
        check_op_count(ops)
        return await apply.apply_ops(self._core, reach, ops, actor, reason, key)

    async def forget(self, reach: Reach, asked: forget.Forget, actor: str) -> forget.Forgotten:
        """Retires every live row in reach holding a value as forgotten, with tombstones."""
        return await forget.forget(self._core, reach, asked, actor)

    async def compact_raw(self, dry_run: bool, actor: str) -> compact.CompactResult:
        """Caps every raw turn of every owner unless dry_run (admin compact_raw)."""
        return await compact.compact_raw(self._core, dry_run, actor)

    async def undo_pass(self, pass_id: str, actor: str = "") -> Undone:
        """Reverts every change a consolidation pass made, newest first, in one transaction."""
        return await undo.undo_pass(self._core, pass_id, actor)

    async def delete_many(self, reach: Reach, layers: Sequence[str], actor: str = "") -> int:
        """Erases every row (live or retired) inside a reach and layers; returns how many."""
        return await apply.delete_many(self._core, reach, layers, actor)

    # -- reads ----------------------------------------------------------------------------

    async def get(self, reach: Reach, memory_id: str) -> MemoryRow:
        """One row, if the reach owns it."""
        return await self._core.get(reach, memory_id)

    async def restate_facts(self, threshold: float, dry_run: bool, actor: str) -> Dedupe:
        """The restatement rule over every stored fact (admin dedupe_facts)."""
        return await dedupe_facts(self._core, threshold, dry_run, actor)

    async def stored_vector(self, memory_id: str) -> list[float]:
        """A row's stored vector of the store's model (empty when it has none)."""
        found = await self._repo.memory_vectors([memory_id], self.model.model_id)
        return found[memory_id].tolist() if memory_id in found else []

    async def list_rows(self, reach: Reach, query: ListQuery) -> ListPage:
        """A page of rows inside the reach, the total that match, and the last one's place."""
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
        if not 0 < query.bucket_s < math.inf:
            raise InvalidArgument("bucket_s must be a positive number of seconds")
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
        distinct_text: bool = False,
    ) -> KeywordResult:
        """Rows containing enough of the query's terms, best score first (see retrieval)."""
        return await retrieval.keyword_search(
            self._repo,
            reach,
            query,
            layers,
            k,
            include_superseded,
            min_terms,
            context_keys,
            distinct_text,
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
        distinct_text: bool = False,
        ids: Sequence[str] = (),
    ) -> list[Scored]:
        """The k rows in reach most similar to vector (cosine), none below min_score; with
        ids, those rows alone (see retrieval)."""
        return await retrieval.vector_search(
            self._core,
            reach,
            vector,
            model_id,
            layers,
            k,
            min_score,
            include_superseded,
            distinct_text,
            ids,
        )

    async def stats(self, reach: Reach, unextracted_after: float | None = None) -> Stats:
        """Row counts in a reach (unextracted: of rows written after unextracted_after, when
        given) and the store's model."""
        live, retired, unextracted, vectors = await self._repo.counts(reach, unextracted_after)
        nodes, edges = await self._repo.graph_counts(reach)
        return Stats(
            layers={layer: live.get(layer, 0) for layer in LAYERS},
            total=sum(live.values()),
            unextracted=unextracted,
            retired=retired,
            db_bytes=await self._repo.db_bytes(),
            vectors=vectors,
            model_id=self.model.model_id,
            ndim=self.model.ndim,
            data_dir=self._location,
            graph_nodes=nodes,
            graph_edges=edges,
        )

    async def list_edges(
        self, reach: Reach, as_of: float | None, include_stale: bool, limit: int, offset: int = 0
    ) -> tuple[list[Edge], int]:
        """A page of a reach's edges: the live graph now, or as it stood at as_of."""
        return await graph.list_edges(self._repo, reach, as_of, include_stale, limit, offset)

    async def neighbours(
        self, reach: Reach, memory_ids: Sequence[str], k: int
    ) -> list[tuple[str, str, float]]:
        """Each memory's k nearest among the given ones: (from, to, cosine), nearest first."""
        return await graph.neighbours(self._core, reach, memory_ids, k)

    async def get_state(self, prefix: str) -> list[tuple[str, str]]:
        """State values under a key prefix."""
        return await self._repo.get_state(prefix)

    async def claim_lease(self, name: str, holder: str, ttl_s: float) -> leases.Lease:
        """Claims, renews or (ttl_s 0) releases a named lease for a holder."""
        return await leases.claim(self._core, name, holder, ttl_s)

    async def history(self, reach: Reach, memory_id: str) -> list[AuditEntry]:
        """The audit trail of one row; still there after a delete, for the row's owner. Entries
        recorded under another user (an erased row's, whose id an import gave a row of theirs)
        are not this row's."""
        entries = await self._repo.history(memory_id) if memory_id else []
        row = await self._repo.get(memory_id) if memory_id else None
        # The row's owner; after a delete, whose its last entry was.
        last = entries[-1][1:] if entries else None
        owner = (row.user_id, row.agent_id) if row is not None else last
        if owner is None or not reach.contains(*owner):
            raise NotFound(f"memory {memory_id!r} not found")
        return [entry for entry, user_id, _ in entries if user_id == owner[0]]

    async def export_page(
        self, reach: Reach, edges: bool, after: int, limit: int, gone: bool = False
    ) -> tuple[list[str], int, bool]:
        """A page of the JSONL export (memories or edges, or with gone what is gone of them),
        its cursor, and whether it is last."""
        return await transfer.export_page(self._core, reach, edges, after, limit, gone)

    async def _line_context(
        self, file_model_id: str, extraction_status: str, write_mode: str
    ) -> LineContext:
        # The states a raw line leaves out are the request's: held to a line's own rule.
        check_states("import", extraction_status, write_mode)
        return LineContext(
            self.model.model_id, self.model.ndim, file_model_id, time.time(),
            extraction_status, write_mode, await self._line_ids(),
        )

    async def _line_ids(self) -> uuid.UUID:
        """The store's namespace of the ids of import lines without one (LINE_IDS_STATE)."""
        if self._line_ids_namespace is None:
            held = dict(await self._repo.get_state(LINE_IDS_STATE)).get(LINE_IDS_STATE)
            if held is None:
                raise Unavailable("the store's schema holds no namespace of import line ids")
            self._line_ids_namespace = uuid.UUID(json.loads(held))
        return self._line_ids_namespace

    async def import_lines(
        self,
        reach: Reach,
        lines: Sequence[tuple[int, str]],
        file_model_id: str,
        extraction_status: str = "",
        write_mode: str = "",
        actor: str = "",
        given: transfer.GivenVectors | None = None,
        sync: bool = False,
    ) -> Imported:
        """Numbered JSONL lines written in one transaction, or none when one is bad; vectors
        embed_import gave for the very lines are used instead of embedding them. With sync,
        changed rows and edges are replaced and gone lines applied (transfer.import_lines)."""
        ctx = await self._line_context(file_model_id, extraction_status, write_mode)
        return await transfer.import_lines(self._core, reach, lines, ctx, actor, given, sync)

    async def embed_import(
        self,
        reach: Reach,
        lines: Sequence[tuple[int, str]],
        file_model_id: str,
        sync: bool = False,
    ) -> tuple[np.ndarray, str, frozenset[int]]:
        """The vectors import_lines would embed for the lines, written nowhere, the model
        that made them, and the lines left out as their id is held."""
        ctx = await self._line_context(file_model_id, "", "")
        return await transfer.embed_lines(self._core, reach, lines, ctx, sync)

    async def snapshot(self) -> Snapshot:
        """A snapshot of the data directory now (writes wait while it is copied)."""
        self._core.sqlite("a snapshot (back PostgreSQL up with pg_dump)")
        if self.snapshots is None:
            raise Conflict("this store was started without a snapshot folder")
        with full_disk_refused("no snapshot was taken"):
            return await self.snapshots.take()

    async def flush(self) -> int:
        """Saves the changed vector indexes and folds SQLite's write-ahead log into the
        database now; returns how many vectors the store holds."""
        indexes = self._core.indexes
        with full_disk_refused("nothing was flushed"):
            if indexes is not None:
                await indexes.save()
            async with self._core.write_lock:
                await self._repo.checkpoint()
        *_, vectors = await self._repo.counts(Reach(None, ""))
        return int(vectors)

    async def owners(self, reach: Reach) -> list[owners.OwnerCount]:
        """Every owner with rows in the reach, with counts and last write."""
        return await owners.list_owners(self._repo, reach)
