"""What the store's rooms need of a database, whichever backend holds it: SQLite (repo.Repo)
or PostgreSQL (pg.repo.PgRepo). Each backend implements both protocols; the rules (what a
write changes, what a search keeps) stay in the rooms, above them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import numpy as np

from services.store.index import IndexChanges, Matches
from services.store.model import (
    DERIVED_LAYERS,
    AuditEntry,
    CountQuery,
    Edge,
    ListPage,
    ListQuery,
    MemoryRow,
    Reach,
)


class Writes(Protocol):
    """Writes inside one open transaction (reads in it see its own writes)."""

    async def get(self, memory_id: str) -> MemoryRow | None:
        """The row as this transaction sees it."""
        ...

    async def owner_rows(
        self, user_id: str, agent_id: str, layer: str, label: str
    ) -> list[MemoryRow]:
        """Every row (live or retired) of one owner, layer and label, oldest first."""
        ...

    async def forget_marks(self, user_id: str, agent_id: str) -> list[MemoryRow]:
        """The rows of one owner that may record a forgotten value: rows retired as forgotten,
        and raw turns whose metadata names tombstones."""
        ...

    async def rows_off_calendar(self, start: float, end: float) -> list[MemoryRow]:
        """Every row with a date (event_at, valid_to, due_at) outside [start, end)."""
        ...

    async def edges_off_calendar(self, start: float, end: float) -> list[Edge]:
        """Every edge with a date (valid_from, valid_to) outside [start, end)."""
        ...

    async def vector(self, memory_id: str) -> np.ndarray:
        """A row's stored vector."""
        ...

    async def insert(self, row: MemoryRow, vector: np.ndarray) -> int:
        """Adds a row and its vector; returns the vector's key."""
        ...

    async def update(self, memory_id: str, fields: dict[str, Any]) -> None:
        """Sets the given columns of one row."""
        ...

    async def replace_vector(
        self, memory_id: str, model_id: str, vector: np.ndarray
    ) -> tuple[int | None, int]:
        """Gives a row a new vector under a new key; returns (old key, new key)."""
        ...

    async def vector_key(self, memory_id: str) -> int | None:
        """The key of a row's vector, if it has one."""
        ...

    async def delete(self, memory_id: str) -> int | None:
        """Erases a row (its vector and keyword entry go with it); returns the vector's key."""
        ...

    async def vector_keys(self, memory_id: str) -> list[int]:
        """The index keys of every extra vector key of a row (clauses, facts)."""
        ...

    async def drop_vector_keys(
        self, memory_id: str, kind: str, text: str | None = None
    ) -> list[int]:
        """Removes a row's extra vector keys of one kind (with that text, when given); returns
        their index keys."""
        ...

    async def add_clause_key(
        self, memory_id: str, kind: str, text: str, model_id: str, vector: np.ndarray
    ) -> int:
        """Adds one vector key pointing at a row; returns its index key."""
        ...

    async def previous_turn(self, row: MemoryRow, since: float) -> tuple[str, str] | None:
        """The id and text of the owner's write before row in the same session and layer."""
        ...

    async def context_key(self, memory_id: str) -> str | None:
        """The text of a row's context key, if it has one."""
        ...

    async def set_context_key(self, memory_id: str, text: str) -> None:
        """Gives a row its context key text (keyword only), replacing any it had."""
        ...

    async def rows_in(self, reach: Reach, layers: Sequence[str]) -> list[MemoryRow]:
        """Every row (live or retired) inside a reach and layers."""
        ...

    async def derived_from(
        self, memory_id: str, layers: Sequence[str] = DERIVED_LAYERS
    ) -> list[MemoryRow]:
        """Rows of the layers (the derived ones, L4, L5, L6, unless told) that list memory_id
        among their evidence."""
        ...

    async def pages_citing(self, memory_id: str) -> list[MemoryRow]:
        """Entity pages (L8) whose metadata names memory_id (a line cites it as a fact)."""
        ...

    async def live_edge(
        self, user_id: str, agent_id: str, key: tuple[str, str, str]
    ) -> Edge | None:
        """The owner's live edge whose names have this key (shared.text.edge_key), if any."""
        ...

    async def get_edge(self, edge_id: str) -> Edge | None:
        """One edge by id."""
        ...

    async def insert_edge(self, edge: Edge) -> None:
        """Adds an edge."""
        ...

    async def update_edge(self, edge_id: str, **fields: Any) -> None:
        """Sets columns of one edge (lists are stored as JSON)."""
        ...

    async def edges_of_memories(self, memory_ids: Sequence[str]) -> list[Edge]:
        """The edges whose searchable memory is one of memory_ids."""
        ...

    async def rowless_edges_on(self, fact_ids: Sequence[str]) -> list[Edge]:
        """The edges with no L5 row that list one of fact_ids among their facts."""
        ...

    async def set_state(
        self, key: str, value: str, at: float, if_value: str | None = None
    ) -> None:
        """Sets one state value; an empty value removes it. With if_value, only while the key
        holds exactly that value (else nothing changes)."""
        ...

    async def record_pass_change(
        self, pass_id: str, kind: str, target_id: str, before: str = ""
    ) -> None:
        """Remembers one change of a consolidation pass for its undo."""
        ...

    async def idempotent_write(
        self, user_id: str, agent_id: str, key: str, since: float
    ) -> tuple[str, list[str]] | None:
        """The request hash and row ids a write recorded under a key since a time, if any."""
        ...

    async def record_idempotent_write(
        self,
        user_id: str,
        agent_id: str,
        key: str,
        request_hash: str,
        ids: Sequence[str],
        at: float,
    ) -> None:
        """Remembers the row ids a write gave under its key."""
        ...

    async def forget_idempotent_writes(self, before: float) -> None:
        """Drops the keys recorded before a time."""
        ...

    async def pass_changes(self, pass_id: str) -> list[tuple[str, str, str]]:
        """A pass's changes, newest first: (kind, target id, before)."""
        ...

    async def audit(
        self,
        *,
        actor: str,
        action: str,
        row: MemoryRow,
        before: MemoryRow | None,
        after: MemoryRow | None,
        reason: str,
        at: float,
    ) -> None:
        """Records one mutation with the row's owner, so history outlives a delete."""
        ...

    async def last_before(self, memory_id: str) -> str:
        """The row as its latest audit entry found it (JSON; "" when none says)."""
        ...

    async def restores_of(self, user_id: str) -> list[tuple[str, str]]:
        """Each restore of the user's rows, oldest first: the row's id and the row as the
        restore found it (JSON)."""
        ...

    async def scrub_history(self, memory_id: str) -> None:
        """Rewrites a row's audit entries as ids, owner, times and states only: its text,
        metadata and every reason but the delete's own are gone (see repo.ERASE_KEEPS)."""
        ...

    async def turns_beside(self, row: MemoryRow) -> tuple[MemoryRow | None, MemoryRow | None]:
        """The owner's rows just before and just after row in its session and layer."""
        ...

    async def merge_keyword_indexes(self) -> None:
        """Has a deleted text's terms leave the keyword index's files (SQLite: tantivy keeps
        them in old segments till the indexes are rebuilt, which checkpoint does after the
        commit)."""
        ...


class Rows(Protocol):
    """Reads of committed rows, and the transactions writes go through."""

    async def answers(self) -> bool:
        """Whether the database answers now (the store's readiness)."""
        ...

    @property
    def keyword_problem(self) -> str:
        """Why keyword searches miss acknowledged writes now ("" when they do not)."""
        ...

    async def checkpoint(self) -> None:
        """Makes deleted text leave the database's files as far as the backend can under the
        write lock (SQLite: the write-ahead log is folded in and truncated, and after an erase
        the keyword indexes are rebuilt in the background)."""
        ...

    async def purge_erased(self) -> None:
        """Makes the text of rows erased before the call leave the database's files, outside
        the write lock so other writes go on meanwhile (PostgreSQL: a vacuum)."""
        ...

    def transaction(
        self, committed: Callable[[], Awaitable[None]] | None = None
    ) -> AbstractAsyncContextManager[Writes]:
        """One write transaction: committed if the block succeeds, then `committed` runs;
        rolled back otherwise, a cancelled caller included."""
        ...

    async def text_search(
        self,
        index: str,
        terms: Sequence[str],
        least: int,
        reach: Reach,
        layers: Sequence[str],
        include_superseded: bool,
        k: int,
    ) -> list[tuple[MemoryRow, float, int]]:
        """Keyword search of one text index ("own": rows' text, "context": their context
        keys): rows in reach holding at least `least` of the stemmed terms, best first, each
        with its score and how many terms it holds."""
        ...

    async def get_meta(self, key: str) -> str | None:
        """A value of the store_meta table."""
        ...

    async def set_meta(self, key: str, value: str) -> None:
        """Sets a value of the store_meta table."""
        ...

    async def memory_vectors(
        self, memory_ids: Sequence[str], model_id: str
    ) -> dict[str, np.ndarray]:
        """The stored vectors (of model_id) of memories, by memory id."""
        ...

    async def vector_models(self) -> dict[str, int]:
        """How many vectors each embedding model made."""
        ...

    async def get(self, memory_id: str) -> MemoryRow | None:
        """One row by id, whoever owns it (callers check the scope)."""
        ...

    async def get_many(
        self,
        reach: Reach,
        memory_ids: Sequence[str],
        layers: Sequence[str] = (),
        include_superseded: bool = True,
    ) -> dict[str, MemoryRow]:
        """The rows with these ids that lie inside the reach (and layers, when given), by id."""
        ...

    async def count_buckets(self, reach: Reach, query: CountQuery) -> list[int]:
        """Rows created in each of query.buckets consecutive windows of query.bucket_s."""
        ...

    async def list_rows(self, reach: Reach, query: ListQuery) -> ListPage:
        """A page of rows inside a reach, how many rows match in all, and the last one's place."""
        ...

    async def replaced_by(
        self, rows: Sequence[MemoryRow], depth: int = 5
    ) -> dict[str, list[MemoryRow]]:
        """For each row's id, the rows of its owner it replaced (and they in turn replaced),
        newest first."""
        ...

    async def turns_followed(
        self, ids: Sequence[str], layers: Sequence[str], gap_s: float
    ) -> dict[str, str]:
        """For each id of a row in one of layers with a session: the row before it in that
        session (same owner and layer), when it was written at most gap_s earlier."""
        ...

    async def memories_of_keys(self, keys: Sequence[int]) -> dict[int, tuple[str, str]]:
        """The memory behind each vector key (own or extra) that still exists, with the text of
        the key when it is one of its memory's sentences ("" otherwise)."""
        ...

    async def keys_in(
        self, reach: Reach, layers: Sequence[str], include_superseded: bool
    ) -> list[int]:
        """Every vector key of the rows inside reach and layers."""
        ...

    async def keys_of(self, reach: Reach, memory_ids: Sequence[str]) -> list[tuple[int, str]]:
        """Every vector key of the given rows inside reach, each with its row's id."""
        ...

    async def user_ids(self) -> list[str]:
        """Every user id that has rows."""
        ...

    async def counts(
        self, reach: Reach, unextracted_after: float | None = None
    ) -> tuple[dict[str, int], int, int, int]:
        """Live rows per layer, retired rows, live unextracted raw rows (written after
        unextracted_after, when given) and vectors in a reach."""
        ...

    async def list_edges(
        self, reach: Reach, as_of: float | None, include_stale: bool, limit: int, offset: int
    ) -> tuple[list[Edge], int]:
        """Edges in a reach, newest first: live now, or as the graph stood at as_of."""
        ...

    async def graph_counts(self, reach: Reach) -> tuple[int, int]:
        """Live edges in a reach and the distinct entities they join."""
        ...

    async def get_state(self, prefix: str) -> list[tuple[str, str]]:
        """State values whose key starts with prefix."""
        ...

    async def owner_counts(self, reach: Reach) -> list[tuple[str, str, int, int, float]]:
        """Every owner (user, agent) with rows in the reach: live and retired row counts and
        the last write, most recently written first."""
        ...

    async def db_bytes(self) -> int:
        """About how many bytes the database takes on disk."""
        ...

    async def history(self, memory_id: str) -> list[tuple[AuditEntry, str, str]]:
        """The audit entries of one row, oldest first, each with the owner it was recorded under."""
        ...


class Vectors(Protocol):
    """Nearest-neighbour search over each user's vector keys (a row's own vector and its clause
    keys): usearch files beside SQLite (index.VectorIndexes), or pgvector (pg.vectors)."""

    async def apply(self, changes: IndexChanges) -> None:
        """Brings the search up to one committed write's keys."""
        ...

    async def search(
        self, user_id: str, vector: np.ndarray, count: int, exact_up_to: int
    ) -> Matches:
        """The nearest keys of a user's (brute force up to exact_up_to vectors)."""
        ...

    async def vectors(self, user_id: str, keys: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """The vectors of the given keys that the user holds, with their keys."""
        ...

    async def save(self) -> int:
        """Makes every change durable where the search keeps its own files; how many vectors
        that wrote."""
        ...
