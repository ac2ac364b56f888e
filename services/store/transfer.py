"""Export and import: pages of JSONL lines out, batches of lines in, one transaction a batch."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from services.store.cascade import entity_of, live_rival
from services.store.core import DEFAULT_ACTOR, Core, Write
from services.store.keys import VECTOR_KINDS, own_keys
from services.store.model import ACTIVE, ENTITY, SUMMARY, AuditEntry, Edge, MemoryRow, Reach
from services.store.pg.repo import PgRepo
from services.store.pg.transfer_repo import PgTransfer, one_snapshot
from services.store.pg.writes import PgWrites
from services.store.repo import row_json
from services.store.transfer_format import (
    EdgeLine,
    GoneLine,
    KeyLine,
    LineContext,
    MemoryLine,
    edge_line,
    gone_line,
    memory_line,
    parse_line,
)
from services.store.transfer_repo import Owner, SqliteTransfer, TransferRows
from services.store.transfer_sync import Stored, changed_columns, replace_edge, take_away
from services.store.validate import MAX_LIMIT, page_size
from shared.errors import InvalidArgument, ServiceError, TooLarge
from shared.layers import ONE_LIVE
from shared.limits import MAX_TRANSFER_LINE_BYTES, TRANSFER_BUDGET_BYTES
from shared.passages import Passage, spans_of

IMPORT_REASON = "import"


@contextlib.asynccontextmanager
async def _committed(core: Core) -> AsyncIterator[TransferRows]:
    """The export's SQL on the store's committed rows as of one moment (so a page's rows,
    vectors, keys and history agree), in whichever backend holds them."""
    if isinstance(core.repo, PgRepo):
        async with one_snapshot(core.repo.db) as sql:
            yield sql
    else:
        async with core.sqlite("export").read_snapshot() as conn:
            yield SqliteTransfer(conn)


def _within(w: Write) -> TransferRows:
    """The import's SQL inside the write's transaction."""
    if isinstance(w.tx, PgWrites):
        return PgTransfer(w.tx.conn)
    return SqliteTransfer(w.core.sqlite("import").writer)


@dataclass
class Imported:
    """What one import batch did: lines written, lines whose id existed (or, gone lines, that
    took nothing away), rows and edges a sync replaced, rows and edges a sync took away as
    gone, and bad lines."""

    imported: int = 0
    skipped: int = 0
    updated: int = 0
    erased: int = 0
    errors: list[tuple[int, str]] = field(default_factory=list)


async def export_page(
    core: Core, reach: Reach, edges: bool, after: int, limit: int, gone: bool = False
) -> tuple[list[str], int, bool]:
    """Lines after the cursor, the cursor of the last one, and whether none follow: memory
    lines, edge lines, or with gone the gone lines of rows deleted for good (of edges undone,
    with edges). A page ends early, before the limit, where its lines would pass
    TRANSFER_BUDGET_BYTES."""
    limit = page_size(limit)
    found: list[tuple[int, dict[str, Any]]]
    async with _committed(core) as sql:
        if gone:
            found = [
                (seq, gone_line("edge" if edges else "memory", *item))
                for seq, item in await sql.gone_after(reach, edges, after, limit)
            ]
        elif edges:
            found = [
                (seq, edge_line(edge)) for seq, edge in await sql.edges_after(reach, after, limit)
            ]
        else:
            rows = await sql.rows_after(reach, after, limit)
            lines = await _memory_lines(sql, [row for _, row in rows])
            found = [(seq, line) for (seq, _), line in zip(rows, lines, strict=True)]
    text: list[str] = []
    cursor, size = after, 0
    for seq, line in found:
        rendered = json.dumps(line, ensure_ascii=False)
        size += len(rendered.encode())
        if text and size > TRANSFER_BUDGET_BYTES:
            return text, cursor, False  # the next page starts at this line
        if size > MAX_TRANSFER_LINE_BYTES:
            kind = line["type"]
            raise TooLarge(
                f"{kind} {line[kind]['id']!r} is {size:,} bytes as an export line; "
                f"at most {MAX_TRANSFER_LINE_BYTES:,} can be exported"
            )
        text.append(rendered)
        cursor = seq
    return text, cursor, len(found) < limit


async def _memory_lines(sql: TransferRows, rows: Sequence[MemoryRow]) -> list[dict[str, Any]]:
    """Each row's line, with its vector, keys and history."""
    ids = [row.id for row in rows]
    vectors = await sql.vectors_of(ids)
    keys = await sql.keys_of(ids)
    history = await sql.history_of(ids)
    return [
        memory_line(row, vectors.get(row.id), keys.get(row.id, []), history.get(row.id, []))
        for row in rows
    ]


UNIT_TOLERANCE = 1e-4
"""How far from 1 a given vector's length may be and count as unit length (float32 rounding of
a normalised vector is about 1e-7)."""


@dataclass
class _Row:
    """A memory line ready to write: its id settled and every vector it needs in hand."""

    line: MemoryLine
    vector: np.ndarray
    key_vectors: list[np.ndarray]


Line = MemoryLine | EdgeLine | GoneLine


def _owner(item: Line) -> MemoryRow | Edge | GoneLine:
    """What holds a line's owner (user_id and agent_id)."""
    if isinstance(item, MemoryLine):
        return item.row
    return item.edge if isinstance(item, EdgeLine) else item


def _parsed(
    lines: Sequence[tuple[int, str]], reach: Reach, ctx: LineContext
) -> tuple[list[Line], list[tuple[int, str]]]:
    """Every line checked; the bad ones with their line number and reason."""
    parsed: list[Line] = []
    errors: list[tuple[int, str]] = []
    for number, text in lines:
        try:
            item = parse_line(text, ctx)
            owner = _owner(item)
            if not reach.contains(owner.user_id, owner.agent_id):
                raise InvalidArgument(f"owner {owner.user_id!r} is outside the request scope")
        except ServiceError as exc:
            errors.append((number, exc.message))
        else:
            parsed.append(item)
    return parsed, errors


_SET_BY_THE_WRITE = frozenset(
    {"model_id", "created_at", "updated_at", "recorded_at", "extraction_status", "write_mode"}
)
"""Fields a line leaves out that the write sets from its moment or its request, not the line."""


def _line_id(
    namespace: uuid.UUID, kind: str, value: MemoryRow | Edge, given: frozenset[str] | None
) -> str:
    """The id of a line without one: a uuid5, in the store's secret namespace, of what it says
    (its owner and every field it gives, and the defaults of the rest but those the write
    sets), so the line sent again, as a retried import sends it, names the row or edge it wrote
    and skips."""
    said = {
        name: item
        for name, item in dataclasses.asdict(value).items()
        if name != "id" and (given is None or name in given or name not in _SET_BY_THE_WRITE)
    }
    text = json.dumps([kind, said], ensure_ascii=False, sort_keys=True)
    return str(uuid.uuid5(namespace, text))


def _with_ids(items: list[Line], namespace: uuid.UUID) -> list[Line]:
    """Lines without an id get the one what they say gives (_line_id)."""
    out: list[Line] = []
    for item in items:
        if isinstance(item, MemoryLine) and not item.row.id:
            memory_id = _line_id(namespace, "memory", item.row, item.given)
            item = replace(item, row=replace(item.row, id=memory_id))
        elif isinstance(item, EdgeLine) and not item.edge.id:
            edge_id = _line_id(namespace, "edge", item.edge, item.given)
            item = replace(item, edge=replace(item.edge, id=edge_id))
        out.append(item)
    return out


def _vector_key_texts(line: MemoryLine) -> list[tuple[str, np.ndarray | None]]:
    """The vector keys a row gets: the line's own, or the clauses an ordinary write derives."""
    if line.keys is None:
        return [(key.text, None) for key in own_keys(line.row.content)]
    return [(key.text, key.vector) for key in line.keys if key.kind in VECTOR_KINDS]


def _to_embed(lines: Sequence[MemoryLine]) -> tuple[list[Passage], list[bool]]:
    """What the batch needs embedded, as passages (clauses as spans of their text, when they
    are), and which of the rows that gives are used, in the order _Fresh.ready takes them."""
    passages: list[Passage] = []
    wanted: list[bool] = []
    for line in lines:
        keys = _vector_key_texts(line)
        needed = [vector is None for _, vector in keys]
        if line.vector is not None and not any(needed):
            continue
        try:
            spans = spans_of(line.row.content, [text for text, _ in keys])
        except ValueError:  # a key that is not part of the text (a fact's): embed it alone
            if line.vector is None:
                passages.append(Passage(line.row.content))
                wanted.append(True)
            passages += [Passage(text) for text, vector in keys if vector is None]
            wanted += [True for need in needed if need]
            continue
        own = tuple(span for span, need in zip(spans, needed, strict=True) if need)
        passage = Passage(line.row.content, own)
        passages.append(passage)
        wanted += [line.vector is None, *(True for _ in passage.spans)]
    return passages, wanted


@dataclass(frozen=True)
class _Batch:
    """An import batch's lines checked, with ids."""

    items: list[Line]
    numbers: list[int]
    """Each item's line number."""

    @property
    def memories(self) -> list[MemoryLine]:
        """The memory lines, in order."""
        return [item for item in self.items if isinstance(item, MemoryLine)]

    @property
    def numbered_memories(self) -> list[tuple[int, MemoryLine]]:
        """The memory lines with their line numbers, in order."""
        return [
            (number, item)
            for number, item in zip(self.numbers, self.items, strict=True)
            if isinstance(item, MemoryLine)
        ]

    @property
    def gone(self) -> list[GoneLine]:
        """The gone lines, in order."""
        return [item for item in self.items if isinstance(item, GoneLine)]


@dataclass(frozen=True)
class GivenVectors:
    """What embed_lines gave for a batch (little-endian float32 rows), its model, and the
    lines it left out as held."""

    data: bytes
    model_id: str
    held_lines: frozenset[int] = frozenset()


@dataclass(frozen=True)
class _Fresh:
    """A batch's freshly embedded vectors, in the order ready takes them (_to_embed's), and
    the numbers of the memory lines left out of them as their id was held (an import skips
    those)."""

    vectors: np.ndarray
    held_lines: frozenset[int]

    def ready(self, batch: _Batch) -> tuple[list[_Row], list[MemoryLine]]:
        """The memory lines not left out, each with its vectors (the ones it brought, else
        the next of these), and the lines left out."""
        fresh = iter(self.vectors)
        ready, left_out = [], []
        for number, line in batch.numbered_memories:
            if number in self.held_lines:
                left_out.append(line)
                continue
            vector = line.vector if line.vector is not None else next(fresh)
            keys = [v if v is not None else next(fresh) for _, v in _vector_key_texts(line)]
            ready.append(_Row(line, vector, keys))
        return ready, left_out


def _not_held(batch: _Batch, held_lines: frozenset[int]) -> list[MemoryLine]:
    """The batch's memory lines but the held ones: those its fresh vectors are for."""
    return [line for number, line in batch.numbered_memories if number not in held_lines]


def _batch(
    lines: Sequence[tuple[int, str]], reach: Reach, ctx: LineContext
) -> tuple[_Batch | None, list[tuple[int, str]]]:
    """The lines as a batch, or their errors when any line is bad."""
    if len(lines) > MAX_LIMIT:
        raise InvalidArgument(f"at most {MAX_LIMIT} lines a batch, got {len(lines)}")
    parsed, errors = _parsed(lines, reach, ctx)
    if errors:
        return None, errors
    items = _with_ids(parsed, ctx.line_ids)
    return _Batch(items, [number for number, _ in lines]), []


async def _held_lines(core: Core, batch: _Batch, sync: bool) -> frozenset[int]:
    """The numbers of the memory lines whose id the store holds now (an import skips them,
    so they need no vectors; _write_batch checks they still are held as it writes). None
    with sync, which replaces a held row whose line differs."""
    memories = batch.numbered_memories
    if sync or not memories:
        return frozenset()
    async with _committed(core) as sql:
        held = await sql.memory_owners([line.row.id for _, line in memories])
    return frozenset(number for number, line in memories if line.row.id in held)


async def _embedded(
    core: Core, batch: _Batch, held_lines: frozenset[int]
) -> tuple[_Fresh, str]:
    """The vectors the batch needs but for the held lines, freshly embedded, and the model
    that made them."""
    # Read before embedding: core.embed asks for this model and refuses vectors of another.
    model_id = core.model.model_id
    passages, wanted = _to_embed(_not_held(batch, held_lines))
    if not passages:
        return _Fresh(np.zeros((0, core.model.ndim), np.float32), held_lines), model_id
    async with core.import_embedding:
        vectors = await core.embed(passages, bulk=True)
    return _Fresh(vectors[np.array(wanted, dtype=bool)], held_lines), model_id


def _fitting(given: GivenVectors | None, batch: _Batch, core: Core) -> _Fresh | None:
    """The given vectors when they are the store's model's, as many as the batch needs but
    for the lines they leave out, and finite and non-zero, scaled to unit length (those of
    unit length already, as the embedder gives them, kept bit for bit); else None (the batch
    is embedded as without them)."""
    ndim = core.model.ndim
    if given is None or given.model_id != core.model.model_id or len(given.data) % (4 * ndim):
        return None
    rows = np.frombuffer(given.data, dtype="<f4").reshape(-1, ndim)
    _, wanted = _to_embed(_not_held(batch, given.held_lines))
    if len(rows) != sum(wanted):
        return None
    norms = np.linalg.norm(rows.astype(np.float64), axis=1, keepdims=True)
    if not np.all(np.isfinite(norms)) or np.any(norms == 0):
        return None
    unit = np.abs(norms - 1.0) <= UNIT_TOLERANCE
    return _Fresh(np.where(unit, rows, rows / norms).astype(np.float32), given.held_lines)


async def embed_lines(
    core: Core,
    reach: Reach,
    lines: Sequence[tuple[int, str]],
    ctx: LineContext,
    sync: bool = False,
) -> tuple[np.ndarray, str, frozenset[int]]:
    """What import_lines would embed for the lines, written nowhere (none when one is bad),
    the model that made them (a re-embed may move the store on meanwhile), and the lines
    left out as their id is held (import_lines skips them)."""
    batch, _ = _batch(lines, reach, ctx)
    if batch is None:
        return np.zeros((0, ctx.ndim), np.float32), ctx.model_id, frozenset()
    fresh, model_id = await _embedded(core, batch, await _held_lines(core, batch, sync))
    return fresh.vectors, model_id, fresh.held_lines


async def import_lines(
    core: Core,
    reach: Reach,
    lines: Sequence[tuple[int, str]],
    ctx: LineContext,
    actor: str,
    given: GivenVectors | None = None,
    sync: bool = False,
) -> Imported:
    """Writes the lines in one transaction, or none of them if any is bad; an id its owner
    holds already skips, one another owner holds is a bad line. With sync, a line that
    differs from the row (or edge) its owner holds replaces it, and a gone line takes its row
    or edge away; without, a gone line skips. Lines whose id is held are not embedded.
    Vectors given for the very lines (embed_lines) are used instead of embedding them."""
    batch, errors = _batch(lines, reach, ctx)
    if batch is None:
        return Imported(errors=errors)
    fresh = _fitting(given, batch, core)
    if fresh is None:
        fresh, _ = await _embedded(core, batch, await _held_lines(core, batch, sync))
    while (done := await _write_batch(core, batch, ctx, actor, fresh, sync)) is None:
        # A line left out as held is to be written now (its row was deleted meanwhile): the
        # batch embedded whole leaves none out.
        fresh, _ = await _embedded(core, batch, frozenset())
    return done


async def _write_batch(
    core: Core, batch: _Batch, ctx: LineContext, actor: str, fresh: _Fresh, sync: bool
) -> Imported | None:
    """import_lines' transaction, with the vectors in hand; None, with nothing written, when
    a line they left out as held is no longer held or sync would replace it."""
    rows, left_out = fresh.ready(batch)
    edge_lines = [item for item in batch.items if isinstance(item, EdgeLine)]
    # The lines were checked, and are embedded, for ctx's model: refused if it changed.
    async with core.writing(actor or DEFAULT_ACTOR, ctx.model_id) as w:
        # A batch that embedded nothing (an export's lines bring their vectors, a resent
        # file's are held) leaves the model idle: see every_core.
        w.changes.every_core = not len(fresh.vectors)
        sql = _within(w)
        # Checked inside the transaction, so a concurrent write of the same id cannot slip in.
        # Memories and edges are separate tables: an edge may share a memory's id.
        held = _Held(
            await sql.memory_owners([line.row.id for line in batch.memories]),
            await sql.edge_owners([line.edge.id for line in edge_lines]),
        )
        if left_out and (sync or any(line.row.id not in held.memories for line in left_out)):
            return None  # nothing written yet: the transaction is empty
        stored = await Stored.read(sql, batch.items) if sync else None
        errors = (
            _held_by_others(batch, held)
            or await _second_live_ones(w, batch, held)
            or (stored.unreplaceable(batch.numbers, batch.items) if stored else [])
        )
        if errors:
            return Imported(errors=errors)  # nothing written yet: the transaction is empty
        # A line left out is held (checked above): it skips, as _write_memories skips one.
        done = Imported(skipped=len(left_out))
        await _write_memories(w, sql, rows, held.memories, stored, done)
        await _write_edges(w, edge_lines, held.edges, stored, done)
        for gone in batch.gone:
            if stored is not None and await take_away(w, stored, gone):
                done.erased += 1
            else:
                done.skipped += 1
    return done


async def _write_memories(
    w: Write,
    sql: TransferRows,
    rows: Sequence[_Row],
    held: Mapping[str, Owner],
    stored: Stored | None,
    done: Imported,
) -> None:
    """Each row whose id is not held written, and with stored (a sync) each held one whose
    line differs replaced; the rest (an id on an earlier line too) skipped."""
    after = _After()
    seen: set[str] = set()
    for row in rows:
        memory_id = row.line.row.id
        first = memory_id not in seen
        seen.add(memory_id)
        if first and memory_id not in held:
            await _write_row(w, row, after)
            done.imported += 1
        elif first and stored is not None and stored.row_changed(
            line := stored.resolved(row.line)
        ):
            await _replace_row(w, sql, stored, replace(row, line=line), after)
            done.updated += 1
        else:
            done.skipped += 1
    await sql.add_context_keys(after.context_keys)
    await sql.add_history(after.history)


async def _write_edges(
    w: Write,
    lines: Sequence[EdgeLine],
    held: Mapping[str, Owner],
    stored: Stored | None,
    done: Imported,
) -> None:
    """As _write_memories, for edges."""
    seen: set[str] = set()
    for line in lines:
        edge = line.edge
        first = edge.id not in seen
        seen.add(edge.id)
        if first and edge.id not in held:
            await w.tx.insert_edge(edge)
            done.imported += 1
        elif first and stored is not None and stored.edge_changed(
            edge := stored.resolved(line).edge
        ):
            await replace_edge(w, stored, edge)
            done.updated += 1
        else:
            done.skipped += 1


@dataclass(frozen=True)
class _Held:
    """The owners of the ids a batch names that the store holds already."""

    memories: dict[str, Owner]
    edges: dict[str, Owner]


def _held_by_others(batch: _Batch, held: _Held) -> list[tuple[int, str]]:
    """The lines whose id another owner's memory (or edge) holds, in the store or on an
    earlier line of the batch. The owner is not named: it may be outside the caller's reach."""
    memories, edges = dict(held.memories), dict(held.edges)
    errors = []
    for number, item in zip(batch.numbers, batch.items, strict=True):
        if isinstance(item, GoneLine):
            continue  # it takes away only what its owner holds
        what, owners, one = (
            ("memory", memories, item.row) if isinstance(item, MemoryLine)
            else ("edge", edges, item.edge)
        )
        owner = (one.user_id, one.agent_id)
        if owners.setdefault(one.id, owner) != owner:
            errors.append((number, f"id {one.id!r} is taken by another {what}"))
    return errors


async def _second_live_ones(w: Write, batch: _Batch, held: _Held) -> list[tuple[int, str]]:
    """The new live lines that would make a second live row of what an owner has one live
    row of (an entity's page, a Now page, an arc): beside one in the store, or one on an
    earlier line."""
    errors = []
    seen: set[tuple[str, ...]] = set()
    for number, item in zip(batch.numbers, batch.items, strict=True):
        if not isinstance(item, MemoryLine) or item.row.id in held.memories:
            continue
        row = item.row
        if row.status != ACTIVE or (key := _one_live_key(w, row)) is None:
            continue
        why = "one on an earlier line is live" if key in seen else await live_rival(w, row)
        seen.add(key)
        if why is not None:
            errors.append((number, f"memory {row.id!r} cannot be live: {why}"))
    return errors


def _one_live_key(w: Write, row: MemoryRow) -> tuple[str, ...] | None:
    """What an owner has one live row of that the row is, with its owner (as live_rival
    reads them: an entity's page by its person, a Now page or arc by its user); None for
    any other row."""
    if row.layer == ENTITY:
        return (*sorted(w.core.alias_group(row.user_id)), row.agent_id, ENTITY, entity_of(row))
    if row.layer == SUMMARY and row.label in ONE_LIVE:
        return (row.user_id, row.agent_id, row.label)
    return None


@dataclass
class _After:
    """What a batch's rows bring that is written once after them, in one statement each."""

    context_keys: list[tuple[str, str]] = field(default_factory=list)
    history: list[tuple[MemoryRow, AuditEntry]] = field(default_factory=list)


async def _write_row(w: Write, ready: _Row, after: _After) -> None:
    """One row through the ordinary insert path, then its keys; its history goes to after."""
    row, line = ready.line.row, ready.line
    w.changes.add(row.user_id, await w.tx.insert(row, ready.vector), ready.vector)
    if line.keys is None:
        await w.add_keys(row, iter(ready.key_vectors))
        await w.add_fact_keys(row, ready.vector)
    else:
        await _write_keys(w, ready, line.keys, after)
    if line.history is None:
        entry = AuditEntry(0, w.now, w.actor, "insert", row.id, "", row_json(row), IMPORT_REASON)
        after.history.append((row, entry))
    else:
        after.history.extend((row, entry) for entry in line.history)


async def _replace_row(
    w: Write, sql: TransferRows, stored: Stored, ready: _Row, after: _After
) -> None:
    """Gives a stored row the line's fields, and when they differ its text's vector, its keys
    and its history (a line without history adds an entry for the change)."""
    row, line = ready.line.row, ready.line
    before = stored.rows[row.id]
    await w.tx.update(row.id, changed_columns(before, row))
    if line.keys is None:  # the keys an ordinary edit, retire or restore leaves it
        if before.content != row.content:
            await w.new_content(before, row.content, iter([ready.vector, *ready.key_vectors]))
        await w.fact_keys_follow(replace(before, content=row.content), row)
    else:
        if before.content != row.content:
            old, new = await w.tx.replace_vector(row.id, w.core.model.model_id, ready.vector)
            w.changes.remove(row.user_id, old)
            w.changes.add(row.user_id, new, ready.vector)
        if stored.keys_differ(line):
            for kind in sorted(VECTOR_KINDS):
                for key in await w.tx.drop_vector_keys(row.id, kind):
                    w.changes.remove(row.user_id, key)
            await sql.drop_context_key(row.id)
            await _write_keys(w, ready, line.keys, after)
    if line.history is None:
        entry = AuditEntry(
            0, w.now, w.actor, "update", row.id, row_json(before), row_json(row), IMPORT_REASON
        )
        after.history.append((row, entry))
    elif stored.history_differs(line):
        await sql.drop_history(row.id, row.user_id)
        after.history.extend((row, entry) for entry in line.history)


async def _write_keys(w: Write, ready: _Row, keys: Sequence[KeyLine], after: _After) -> None:
    """The keys a line brought, as they were: vector keys with vectors, the context key's text."""
    row = ready.line.row
    key_vectors = iter(ready.key_vectors)
    for key in keys:
        if key.kind in VECTOR_KINDS:
            vector = next(key_vectors)
            index_key = await w.tx.add_clause_key(
                row.id, key.kind, key.text, w.core.model.model_id, vector
            )
            w.changes.add(row.user_id, index_key, vector)
        else:
            after.context_keys.append((row.id, key.text))
