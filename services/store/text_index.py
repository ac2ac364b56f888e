"""The keyword indexes (tantivy): the memories' own texts and the context keys, each a folder
beside the database that follows the text_changes log SQLite's triggers write.

A row's change is logged in the same transaction as the row, so the log is as durable as the
rows. An index applies the log from the position it last committed (a file beside its segments,
written after each commit); applying is idempotent (a changed row is deleted, then added as it
now reads), so a crash between the two commits only replays. A search first applies what is
pending, so it sees every acknowledged write.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite
import tantivy

from services.store.durable import put_in_place
from shared.runtime import trim_heap

log = logging.getLogger(__name__)
T = TypeVar("T")

# The folder under the data directory that holds the indexes; snapshots leave it out (a store
# builds missing indexes from the rows when it opens).
KEYWORDS_FOLDER = "keywords"
ANALYZER = "words"
# Log rows applied in one batch (one commit): a bulk import's rows are applied in a few.
BATCH = 20_000
# The indexing arena of one writer, the smallest tantivy takes.
WRITER_HEAP = 15_000_000
# A build checks between this many rows whether its index is closing.
BUILD_STEP = 5_000


class Closing(Exception):
    """A build given up because its index is closing."""


def analyzer() -> tantivy.TextAnalyzer:
    """How a text becomes terms: runs of letters and digits, lower case, accents folded,
    Snowball English stems (keywords.stem makes the same)."""
    return (
        tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
        .filter(tantivy.Filter.remove_long(255))
        .filter(tantivy.Filter.lowercase())
        .filter(tantivy.Filter.ascii_fold())
        .filter(tantivy.Filter.stemmer("english"))
        .build()
    )


def _schema() -> tantivy.Schema:
    builder = tantivy.SchemaBuilder()
    builder.add_text_field("text", stored=False, tokenizer_name=ANALYZER, index_option="freq")
    builder.add_text_field("owner", stored=False, tokenizer_name="raw", index_option="basic")
    builder.add_integer_field("id", stored=False, indexed=True, fast=True)
    return builder.build()


@dataclass(frozen=True)
class Source:
    """Where one index's texts come from in SQLite."""

    name: str
    rows: str
    """SELECT of (id, text, owner key) for every indexed row."""
    some: str
    """The same for the ids of a JSON array (?)."""


OWN = Source(
    "own",
    "SELECT seq, content, owner_key FROM memories",
    "SELECT seq, content, owner_key FROM memories WHERE seq IN (SELECT value FROM json_each(?))",
)
CONTEXT = Source(
    "context",
    "SELECT key, text, owner_key FROM memory_keys WHERE kind = 'context'",
    "SELECT key, text, owner_key FROM memory_keys WHERE kind = 'context' "
    "AND key IN (SELECT value FROM json_each(?))",
)
SOURCES = {source.name: source for source in (OWN, CONTEXT)}


class KeywordIndex:
    """One tantivy index following its source through the change log."""

    def __init__(self, folder: Path, source: Source) -> None:
        self.folder = folder
        self.source = source
        self.schema = _schema()
        self.analyzer = analyzer()
        self.applied = 0
        """The highest log seq this index holds (committed)."""
        self.ids = IdSpan(0, 0)
        """About the lowest and the highest id indexed (the lowest may since be deleted)."""
        self._index: tantivy.Index | None = None
        self._writer: tantivy.IndexWriter | None = None
        """Kept from batch to batch while commits keep coming (let go once the store sits idle,
        see let_go): the merges a commit starts go on in its threads, where a writer made for
        each batch had to wait for them (up to 45 ms under four writers)."""
        self._lock = asyncio.Lock()
        self._closing = False
        self._threads: set[asyncio.Future[Any]] = set()
        self._rebuilds_from: list[int] = []
        """The log positions rebuilds in progress read their rows at."""

    @property
    def log_needed_after(self) -> int:
        """The log seq after which this index still needs every log row: what it applied, or
        where a rebuild in progress read its rows (the new index applies the log from there
        once it is swapped in), whichever is lower."""
        return min([self.applied, *self._rebuilds_from])

    @property
    def _position(self) -> Path:
        return self.folder / "applied"

    async def open(self, conn: aiosqlite.Connection, rebuild: bool = False) -> None:
        """Opens the index, then builds it when asked, when it is missing or when it is ahead
        of the log (a database put back from an older copy); follow applies what is pending.
        A build that fails leaves the index as it was opened, or not built."""
        high = await log_high(conn)
        applied = _read_position(self._position)
        self._remove_leftovers()
        if applied is not None and applied <= high:
            try:
                self._index = self.opened_at(self.folder)
                self.ids = await self._in_thread(_id_span, self._index)
                self.applied = applied
            except ValueError as exc:  # tantivy's error for files it cannot read
                log.warning("keyword index %s is unreadable (%s); building it", self.folder, exc)
        if rebuild or self._index is None:
            await self.rebuild(conn)

    def opened_at(self, folder: Path) -> tantivy.Index:
        """The index in a folder (created there if it holds none), with this index's schema
        and analyzer."""
        index = tantivy.Index(self.schema, path=str(folder), reuse=True)
        index.register_tokenizer(ANALYZER, self.analyzer)
        return index

    @property
    def built(self) -> bool:
        """Whether the index is open: one whose build the disk refused is not, till a build
        succeeds (searches find nothing in it meanwhile)."""
        return self._index is not None

    @property
    def index(self) -> tantivy.Index:
        if self._index is None:
            raise RuntimeError(f"text index {self.source.name} is not open")
        return self._index

    async def follow(self, conn: aiosqlite.Connection, high: int | None = None) -> None:
        """Applies the log rows after the index's position, up to the log's end as it is now,
        a batch per commit; high is that end when the caller has just read it (LOG_HIGH).

        Rows committed meanwhile are left to the next follow: chasing them held the lock a
        search waits on for as long as writes kept landing (up to 1.2 s under four writers).
        A caller that gives up (a search past its deadline) leaves the batch in hand to be
        applied under the lock: its thread goes on, and a second follow would apply it beside.
        An index that holds every change committed so far is not waited for: a search then
        goes on while the lock is held for other work (a writer let go waits for its merges).
        """
        if high is None:
            high = await log_high(conn)
        if self._index is not None and self.applied >= high:
            return
        await asyncio.shield(self._follow(conn))

    async def _follow(self, conn: aiosqlite.Connection) -> None:
        async with self._lock:
            if self._index is None:  # its build reads every row
                return
            # Every row up to the log's end is committed by the time it is read.
            high = await log_high(conn)
            while high > self.applied and not self._closing:
                changes = await conn.execute_fetchall(
                    "SELECT seq, id FROM text_changes WHERE seq > ? AND seq <= ? AND kind = ? "
                    "ORDER BY seq LIMIT ?",
                    (self.applied, high, self.source.name, BATCH),
                )
                batch = list(changes)
                if not batch:
                    # Only other indexes' rows lie beyond: this one holds all of its own.
                    self.applied = max(self.applied, high)
                    return
                ids = sorted({int(row_id) for _, row_id in batch})
                rows = await conn.execute_fetchall(self.source.some, (json.dumps(ids),))
                await self._in_thread(self._apply, ids, list(rows), int(batch[-1][0]))

    def _apply(self, ids: Sequence[int], rows: Sequence[Sequence[Any]], upto: int) -> None:
        if self._writer is None:
            self._writer = self.index.writer(heap_size=WRITER_HEAP, num_threads=1)
        writer = self._writer
        try:
            for row_id in ids:
                writer.delete_documents_by_term("id", row_id)
            _add(writer, rows)
            writer.commit()
        except BaseException:
            writer.rollback()  # the next follow applies the batch again
            raise
        _write_position(self._position, upto)
        self.index.reload()
        self.ids = self.ids.widened([int(row[0]) for row in rows])
        self.applied = upto

    async def rebuild(self, conn: aiosqlite.Connection) -> None:
        """Builds the index anew from every row, then swaps it in: also how a deleted text's
        terms leave the index's files (tantivy keeps them in old segments till a merge).
        Searches go on with the old index while the new one is built."""
        # The log's end first: the rows read after it hold every change up to it, and the
        # changes after it are applied again once the index is swapped in (applying is
        # idempotent; the log keeps them till then, see log_needed_after).
        high = await log_high(conn)
        self._rebuilds_from.append(high)
        try:
            rows = list(await conn.execute_fetchall(self.source.rows))
            fresh = await self._in_thread(self._build, rows, high)
            async with self._lock:
                self._index = await self._in_thread(self._swap, fresh)
                self.ids = IdSpan(0, 0).widened([int(row[0]) for row in rows])
                self.applied = high
        finally:
            self._rebuilds_from.remove(high)
        log.info("built keyword index %s: %d rows", self.source.name, len(rows))
        del rows
        # Every row's text was read and the build's writer took a large arena: the pages they
        # freed go back to the system now, not at the next idle round after a later commit.
        await asyncio.to_thread(trim_heap)

    def _build(self, rows: Sequence[Sequence[Any]], high: int) -> Path:
        # A folder of its own: a build whose caller was cancelled (the store stopping) may go
        # on in its thread while the next one starts.
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        fresh = Path(tempfile.mkdtemp(prefix=self.folder.name + ".new-", dir=self.folder.parent))
        try:
            self._fill(fresh, rows, high)
        except BaseException:
            # Given up, or refused by a full disk: what it wrote would hold the disk's last
            # free bytes till the next open.
            shutil.rmtree(fresh, ignore_errors=True)
            raise
        return fresh

    def _fill(self, fresh: Path, rows: Sequence[Sequence[Any]], high: int) -> None:
        writer = self.opened_at(fresh).writer(heap_size=WRITER_HEAP * 4, num_threads=1)
        for start in range(0, len(rows), BUILD_STEP):
            self._unless_closing()
            _add(writer, rows[start : start + BUILD_STEP])
        writer.commit()
        writer.wait_merging_threads()
        self._unless_closing()
        _write_position(fresh / "applied", high)

    def _unless_closing(self) -> None:
        """Gives a build up (what its writer holds uncommitted is dropped with its folder)
        once the index is closing."""
        if self._closing:
            raise Closing(self.source.name)

    def _swap(self, fresh: Path) -> tantivy.Index:
        self._end_writer()
        old = self.folder.with_name(self.folder.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if self.folder.exists():
            self.folder.rename(old)
        put_in_place(fresh, self.folder)
        shutil.rmtree(old, ignore_errors=True)
        return self.opened_at(self.folder)

    async def let_go(self) -> None:
        """Ends the writer (the next batch makes another): the indexing arena a writer keeps
        from batch to batch, about 24 MB once it has indexed a few thousand rows, is freed."""
        async with self._lock:
            if self._writer is not None:
                await self._in_thread(self._end_writer)

    @property
    def holds_writer(self) -> bool:
        """Whether a writer is kept for the next batch."""
        return self._writer is not None

    async def close(self) -> None:
        """Waits for the work of its threads: a build gives up (its caller may be cancelled,
        its thread goes on till it checks); the application of a batch ends."""
        self._closing = True
        await asyncio.gather(*self._threads, return_exceptions=True)
        await asyncio.to_thread(self._end_writer)

    def _end_writer(self) -> None:
        """Lets the writer's merges finish and releases the folder's writer lock."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.wait_merging_threads()

    async def _in_thread(self, work: Callable[..., T], *args: Any) -> T:
        """Runs work in a thread of the loop's executor, known to close() till it ends."""
        future = asyncio.get_running_loop().run_in_executor(None, work, *args)
        self._threads.add(future)
        future.add_done_callback(self._threads.discard)
        return await asyncio.shield(future)

    def _remove_leftovers(self) -> None:
        """Removes the folders of builds and swaps a stopped store left unfinished."""
        name = self.folder.name
        builds = self.folder.parent.glob(name + ".new-*")
        for folder in (*builds, self.folder.with_name(name + ".old")):
            shutil.rmtree(folder, ignore_errors=True)

    def newest_ids(self, share: float) -> int:
        """The lowest id of about the newest `share` of the index's ids (ids only grow)."""
        count = math.ceil((self.ids.high - self.ids.low + 1) * min(max(share, 0.0), 1.0))
        return self.ids.high - count + 1

    def terms(self, words: Sequence[str]) -> list[str | None]:
        """Each query word's term in the index (None for one the analyzer drops)."""
        found = []
        for word in words:
            tokens = self.analyzer.analyze(word)
            found.append(tokens[0] if tokens else None)
        return found


@dataclass(frozen=True)
class IdSpan:
    low: int
    high: int

    def widened(self, ids: Sequence[int]) -> IdSpan:
        """The span holding these ids too (an empty span, 0 to 0, holds none)."""
        if not ids:
            return self
        low = min(ids) if self.high == 0 else min(self.low, *ids)
        return IdSpan(low, max(self.high, *ids))


def _id_span(index: tantivy.Index) -> IdSpan:
    """The lowest and the highest id an index holds (two reads of the id column)."""
    searcher = index.searcher()
    ends = []
    for order in (tantivy.Order.Asc, tantivy.Order.Desc):
        hits = searcher.search(
            tantivy.Query.all_query(), 1, count=False, order_by_field="id", order=order
        ).hits
        if not hits:
            return IdSpan(0, 0)
        ends.append(int(searcher.fast_field_values("id", [hits[0][1]])[0] or 0))
    return IdSpan(ends[0], ends[1])


def _add(writer: tantivy.IndexWriter, rows: Sequence[Sequence[Any]]) -> None:
    """Adds (id, text, owner key) rows as documents."""
    for row_id, text, owner in rows:
        writer.add_document(tantivy.Document(id=int(row_id), text=str(text), owner=str(owner)))


LOG_HIGH = "SELECT seq FROM sqlite_sequence WHERE name = 'text_changes'"
"""The highest seq the change log ever gave (its rows may be pruned since)."""


def high_of(rows: Iterable[Sequence[Any]]) -> int:
    """LOG_HIGH's answer as a number (0 before the first change)."""
    found = list(rows)
    return int(found[0][0]) if found else 0


async def log_high(conn: aiosqlite.Connection) -> int:
    """The highest seq the change log ever gave, read on conn."""
    return high_of(await conn.execute_fetchall(LOG_HIGH))


def _read_position(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _write_position(path: Path, seq: int) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(str(seq))
    put_in_place(temporary, path)
