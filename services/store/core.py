"""What every room of the store shares: its parts, the write in progress, and row keys."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from services.store.disk_full import full_disk_refused
from services.store.index import IndexChanges
from services.store.keys import (
    CLAUSE,
    CONTEXT_LAYERS,
    FACT,
    FACT_KEY_LAYERS,
    NEIGHBOUR_GAP_S,
    context_text,
    own_keys,
)
from services.store.mirrors import FactChange
from services.store.model import ACTIVE, EVERY_ROW, RETIRED, ListQuery, MemoryRow, Reach
from services.store.repo import Repo
from services.store.rows import Rows, Vectors, Writes
from shared.errors import Conflict, InvalidArgument, NotFound, Unavailable, Unimplemented
from shared.grants import Grant
from shared.limits import check_name
from shared.passages import Passage

DEFAULT_ACTOR = "api"


class Embedder(Protocol):
    """What the store needs from the embedder service."""

    async def embed_passages(
        self, passages: Sequence[Passage], model_id: str = "", *, bulk: bool = False
    ) -> tuple[np.ndarray, str]: ...


@dataclass(frozen=True)
class VectorModel:
    """The embedding model the store's vectors come from, and why searching may be refused."""

    model_id: str
    ndim: int
    mismatch: str = ""


@dataclass
class Core:
    """The store's database, indexes, embedder and model, the lock every write takes, and the
    one an import batch's embedding takes."""

    repo: Rows
    indexes: Vectors | None
    embedder: Embedder
    model: VectorModel
    alias_group: Callable[[str], tuple[str, ...]]
    exact_up_to: int
    first_id: Callable[[str], str] = str
    """The first id of a user's alias group, under which the services keep what they derive
    for the group (its Now page, summaries); str, each id its own, when none is given."""
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    import_embedding: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while an import batch is embedded: the embedder refuses a call while another's
    texts wait past HYATLAS_EMBED_MAX_QUEUE (a batch of 500 lines is over a thousand vectors),
    so a batch asked for while the one before still embeds waits here, read and checked, and
    goes the moment that one is done."""

    def reach(
        self, user_id: str, agent_id: str = "", all_users: bool = False, grant: Grant | None = None
    ) -> Reach:
        """The owners a scope reaches: the user's alias group (or everyone), maybe one agent;
        with a caller's grant, an owner outside it is refused, everyone is the granted, and an
        alias group is narrowed to the aliases the grant names."""
        check_name("scope.user_id", user_id)
        check_name("scope.agent_id", agent_id)
        if all_users:
            reach = Reach(None, agent_id)
        elif not user_id:
            raise InvalidArgument("scope.user_id is required (or scope.all_users)")
        else:
            reach = Reach(self.alias_group(user_id), agent_id)
        return reach if grant is None else self._granted(reach, user_id, all_users, grant)

    def fed_by(self, user_id: str) -> tuple[str, ...]:
        """The user ids whose turns feed what the services keep under user_id: its alias group
        when user_id is the group's first id, else user_id alone."""
        return self.alias_group(user_id) if self.first_id(user_id) == user_id else (user_id,)

    def _granted(self, reach: Reach, user_id: str, all_users: bool, grant: Grant) -> Reach:
        if not all_users:
            grant.check_owner(user_id, reach.agent_id)
        if grant.users is not None:
            users = reach.user_ids if reach.user_ids is not None else sorted(grant.users)
            reach = replace(reach, user_ids=tuple(u for u in users if u in grant.users))
        if grant.agents is not None:
            reach = replace(reach, agent_ids=tuple(sorted(grant.agents)))
        return reach

    @property
    def backend(self) -> str:
        """Where the rows are kept: "sqlite" or "postgresql"."""
        return "sqlite" if isinstance(self.repo, Repo) else "postgresql"

    def sqlite(self, what: str) -> Repo:
        """The SQLite database, for what only the SQLite store has built; on another backend
        `what` answers UNIMPLEMENTED."""
        if not isinstance(self.repo, Repo):
            raise Unimplemented(f"{what} is not built for the PostgreSQL store yet")
        return self.repo

    async def get(self, reach: Reach, memory_id: str) -> MemoryRow:
        """One row, if the reach owns it."""
        row = await self.repo.get(memory_id) if memory_id else None
        if row is None or not reach.contains(row.user_id, row.agent_id):
            raise NotFound(f"memory {memory_id!r} not found")
        return row

    async def all_rows(self, reach: Reach, query: ListQuery) -> list[MemoryRow]:
        """Every row the query matches inside the reach, oldest first, in one read (pages read
        one after another skip a row when one before it leaves the filter meanwhile)."""
        every = replace(query, newest_first=False, limit=EVERY_ROW, offset=0)
        return (await self.repo.list_rows(reach, every)).rows

    async def embed(self, passages: Sequence[Passage], *, bulk: bool = False) -> np.ndarray:
        """The vectors of passages (each text's, then its spans'), refused when the embedder's
        model is not the store's; bulk work yields to the others (see EmbedRequest.bulk)."""
        if self.model.mismatch:
            raise Conflict(self.model.mismatch)
        # Named: during a re-embed the embedder runs the new model too.
        vectors, model_id = await self.embedder.embed_passages(
            passages, self.model.model_id, bulk=bulk
        )
        if model_id != self.model.model_id:
            raise Conflict(
                f"the embedder now runs {model_id!r} but the store holds "
                f"{self.model.model_id!r} vectors; restart the store to re-check"
            )
        return vectors

    @contextlib.asynccontextmanager
    async def writing(self, actor: str, embedded_with: str = "") -> AsyncIterator[Write]:
        """One write under the lock, in one transaction; the indexes follow once it commits,
        and an erase's text has left the files before it returns.

        embedded_with: the model that made the write's vectors before it waited for the lock.
        When a re-embed moved the store to another model meanwhile, the write is refused
        (Unavailable: nothing written, send it again), so no row keeps an old model's vector.
        """
        async with self.write_lock:
            if embedded_with and embedded_with != self.model.model_id:
                raise Unavailable(
                    f"the store moved from model {embedded_with!r} to {self.model.model_id!r} "
                    "while this write was embedded; nothing was written, send it again"
                )
            changes = IndexChanges()

            async def follow() -> None:
                if self.indexes is not None:
                    await self.indexes.apply(changes)

            with full_disk_refused("the write was not kept"):
                async with self.repo.transaction(follow) as tx:
                    # Dated once the transaction holds the database's write lock (on PostgreSQL
                    # shared by every replica), so write times follow the order writes commit.
                    write = Write(self, tx, actor, time.time(), changes)
                    yield write
                    if write.erased:
                        await tx.merge_keyword_indexes()
            if write.erased:
                # The deleted text is still in the write-ahead log's older frames till then.
                await self.repo.checkpoint()
        if write.erased:
            # Outside the lock: other writes go on while PostgreSQL vacuums.
            await self.repo.purge_erased()


@dataclass
class Write:
    """A write in progress: its transaction, who and when, and what it changed so far."""

    core: Core
    tx: Writes
    actor: str
    now: float
    changes: IndexChanges = field(default_factory=IndexChanges)
    # Entity pages whose marks changed: rendered again before the transaction ends.
    pages: set[str] = field(default_factory=set)
    facts_changed: list[FactChange] = field(default_factory=list)
    # Whether a row was deleted for good (see erase): its text must leave the files too.
    erased: bool = False

    def same_person(self, one: str, other: str) -> bool:
        """Whether two user ids are one person (the same, or aliases: HYATLAS_USER_ALIASES).
        What rests on a row is followed only within its person: an id another person's row
        holds is no evidence of these rows, so no user's change reaches another's rows."""
        return other in self.core.alias_group(one)

    async def change(
        self, before: MemoryRow, action: str, fields: dict[str, Any], reason: str
    ) -> MemoryRow | None:
        """Updates one row's fields and audits it; returns the row as it is now. A fact that is
        retired stops being a key of its turns, and one restored is again."""
        await self.tx.update(before.id, {"updated_at": self.now, **fields})
        after = await self.tx.get(before.id)
        await self.tx.audit(
            actor=self.actor, action=action, row=before, before=before, after=after,
            reason=reason, at=self.now,
        )
        if after is not None:
            await self.fact_keys_follow(before, after)
        return after

    async def fact_keys_follow(self, before: MemoryRow, after: MemoryRow) -> None:
        """A fact retired since before stops being a key of its turns, and one restored is
        again."""
        if after.layer in FACT_KEY_LAYERS and before.status != after.status:
            if after.status == ACTIVE:
                await self.add_fact_keys(after, await self.tx.vector(after.id))
            elif before.status == ACTIVE:
                await self.drop_fact_keys(before)

    async def add_keys(
        self, row: MemoryRow, vectors: Iterator[np.ndarray], neighbour: bool = True
    ) -> None:
        """Writes a row's extra keys: its clauses, and for a turn its place in the talk."""
        for key in own_keys(row.content):
            vector = next(vectors)
            self.changes.add(
                row.user_id,
                await self.tx.add_clause_key(
                    row.id, key.kind, key.text, self.core.model.model_id, vector
                ),
                vector,
            )
        if row.layer not in CONTEXT_LAYERS:
            return
        previous = await self.tx.previous_turn(row, row.created_at - NEIGHBOUR_GAP_S)
        before = previous[1] if previous is not None else None
        await self.tx.set_context_key(row.id, context_text(before, row.content, None))
        if previous is not None and neighbour:
            # The turn before now has a turn after: its key grows by this one.
            prior = await self.tx.context_key(previous[0])
            await self.tx.set_context_key(
                previous[0], context_text(None, prior or previous[1], row.content)
            )

    async def new_content(
        self, before: MemoryRow, content: str, vectors: Iterator[np.ndarray]
    ) -> None:
        """A row's new text takes the next vectors: its own, then its clause keys'."""
        vector = next(vectors)
        old, new = await self.tx.replace_vector(before.id, self.core.model.model_id, vector)
        self.changes.remove(before.user_id, old)
        self.changes.add(before.user_id, new, vector)
        for clause_key in await self.tx.drop_vector_keys(before.id, CLAUSE):
            self.changes.remove(before.user_id, clause_key)
        await self.drop_fact_keys(before)
        row = replace(before, content=content, created_at=self.now)
        await self.add_keys(row, vectors, neighbour=False)
        await self.add_fact_keys(row, vector)

    async def add_fact_keys(self, row: MemoryRow, vector: np.ndarray) -> None:
        """Makes a live fact (or intention) a key of each turn it cites, with its text and
        vector."""
        if row.status != ACTIVE:
            return
        for turn in await self._cited_turns(row):
            key = await self.tx.add_clause_key(
                turn.id, FACT, row.content, self.core.model.model_id, vector
            )
            self.changes.add(turn.user_id, key, vector)

    async def drop_fact_keys(self, row: MemoryRow) -> None:
        """Takes a fact's keys (its text as it is now) off the turns it cites."""
        for turn in await self._cited_turns(row):
            for key in await self.tx.drop_vector_keys(turn.id, FACT, row.content):
                self.changes.remove(turn.user_id, key)

    async def _cited_turns(self, row: MemoryRow) -> list[MemoryRow]:
        """The owner's turns a row of a fact-key layer cites; none for another layer."""
        if row.layer not in FACT_KEY_LAYERS:
            return []
        turns = []
        for source_id in dict.fromkeys(row.source_ids):
            turn = await self.tx.get(source_id)
            if turn is not None and turn.layer in CONTEXT_LAYERS and turn.user_id == row.user_id:
                turns.append(turn)
        return turns


async def target(tx: Writes, reach: Reach, memory_id: str) -> MemoryRow:
    """The row an op names, if the reach owns it."""
    return owned(reach, memory_id, await tx.get(memory_id))


def owned(reach: Reach, memory_id: str, row: MemoryRow | None) -> MemoryRow:
    """The row, if it is there and the reach owns it; NotFound either way otherwise."""
    if row is None or not reach.contains(row.user_id, row.agent_id):
        raise NotFound(f"memory {memory_id!r} not found")
    return row


def retired_fields(
    now: float, actor: str, how: str, by: str = "", reason: str = ""
) -> dict[str, Any]:
    """The fields that retire a row."""
    return {
        "status": RETIRED, "invalid_at": now, "superseded_by": by, "superseded_how": how,
        "drop_reason": reason, "retired_by": actor,
    }


def live_fields() -> dict[str, Any]:
    """The fields that make a retired row live again."""
    return {
        "status": ACTIVE, "invalid_at": None, "superseded_by": "", "superseded_how": "",
        "drop_reason": "", "retired_by": "",
    }
