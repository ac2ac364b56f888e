"""Export and import: a store as JSONL, streamed out page by page and in batch by batch."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from bisect import insort
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.errors import CLIENT_WENT_AWAY, client_message, http_message
from gateway.params import Params
from gateway.read_timeouts import body_chunks, streams_body
from gateway.respond import all_users, json_response, owner_scope, rpc_timeout
from gateway.state import CONFIG, STORE
from gateway.wording import extraction_status
from shared.errors import InvalidArgument, PermissionDenied, ServiceError, TooLarge
from shared.export_format import (
    Header,
    cut_short,
    end,
    end_count,
    gone_refused,
    header,
    read_header,
)
from shared.grants import reaches_everyone
from shared.limits import MAX_TRANSFER_LINE_BYTES, TRANSFER_BUDGET_BYTES
from shared.pb import common_pb2, store_pb2

# Lines a store call carries at most: a page of the export, a transaction of the import (each
# also ends early at shared.limits.TRANSFER_BUDGET_BYTES, so a call stays under gRPC's limit).
PAGE_LINES = 500
BATCH_LINES = 500
# One import batch may embed a few thousand texts on a busy machine.
IMPORT_TIMEOUT_S = 10 * 60.0
# Errors listed in an import's reply (the rest are counted).
MAX_LISTED_ERRORS = 100
CHUNK_BYTES = 1 << 16
EVERY_OWNER = "exporting every owner is off: pass user_id, or restart with HYATLAS_ADMIN=on"

log = logging.getLogger(__name__)

routes = web.RouteTableDef()


def _export_scope(request: web.Request) -> common_pb2.Scope:
    params = Params(request.query, {})
    user_id, agent_id = params.string("user_id"), params.string("agent_id")
    if user_id:
        return owner_scope(user_id, agent_id)
    # A token that reaches only some owners exports those (the store narrows every owner to
    # its grant); every owner of the server is HYATLAS_ADMIN's to allow.
    if reaches_everyone() and not request.app[CONFIG].admin:
        raise PermissionDenied(EVERY_OWNER)
    return common_pb2.Scope(all_users=True, agent_id=agent_id)


async def _pages(
    request: web.Request, scope: common_pb2.Scope, gone: bool
) -> AsyncIterator[store_pb2.ExportPageResponse]:
    """Every page of memory lines, then every page of edge lines; with gone, then the gone
    lines of rows deleted for good and of edges undone."""
    phases = [(False, False), (True, False)] + ([(False, True), (True, True)] if gone else [])
    for edges, gone_ones in phases:
        after, done = 0, False
        while not done:
            page = await request.app[STORE].ExportPage(
                store_pb2.ExportPageRequest(
                    scope=scope, edges=edges, after=after, limit=PAGE_LINES, gone=gone_ones
                ),
                timeout=rpc_timeout(request),
            )
            after, done = page.cursor, page.done
            yield page


@routes.get("/api/v1/export")
async def export(request: web.Request) -> web.StreamResponse:
    """Streams the scope's rows (with vectors, keys and history) and edges as JSONL, and with
    gone=true the ids of what is gone from it (for an import with sync=true)."""
    scope = _export_scope(request)
    gone = Params(request.query, {}).boolean("gone", False)
    stats = await request.app[STORE].GetStats(
        store_pb2.GetStatsRequest(scope=all_users()), timeout=rpc_timeout(request)
    )
    pages = _pages(request, scope, gone)
    first = await anext(pages)  # a refusal still comes back as a JSON error
    response = web.StreamResponse(
        headers={
            "Content-Type": "application/x-ndjson; charset=utf-8",
            "Content-Disposition": 'attachment; filename="hyatlas-export.jsonl"',
        }
    )
    await response.prepare(request)
    head = header(stats.model_id, stats.ndim, time.time(), gone)
    await response.write(_jsonl([json.dumps(head)]))
    await response.write(_jsonl(first.lines))
    sent = 1 + len(first.lines)
    try:
        async for page in pages:
            await response.write(_jsonl(page.lines))
            sent += len(page.lines)
    except ServiceError as exc:
        # The 200 went out with the first page: a last line says why, and the stream is left
        # unended (the connection closes once that line is sent) so a client sees it incomplete.
        log.error("export cut short: %s", exc)
        await response.write(_jsonl([json.dumps(cut_short(client_message(request, exc)))]))
        if request.transport is not None:
            request.transport.close()
        return response
    # Only a whole export ends with it: a copy cut at a line's end is told from a whole one.
    await response.write(_jsonl([json.dumps(end(sent))]))
    await response.write_eof()
    return response


def _jsonl(lines: Any) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


async def _numbered_lines(request: web.Request) -> AsyncIterator[tuple[int, bytes]]:
    """The body's non-blank lines with their line numbers, read as they arrive."""
    limit = request.app[CONFIG].max_body_bytes
    number, pending_bytes = 0, 0
    pending: list[bytes] = []  # the line not ended yet, in pieces
    async for chunk in body_chunks(request, CHUNK_BYTES):
        *ended, rest = chunk.split(b"\n")
        for piece in ended:
            number += 1
            raw = b"".join([*pending, piece])
            pending, pending_bytes = [], 0
            if raw.strip():
                yield number, raw
        pending.append(rest)
        pending_bytes += len(rest)
        if pending_bytes > limit:
            raise InvalidArgument(f"line {number + 1} is over the {limit} byte limit")
    raw = b"".join(pending)
    if raw.strip():
        yield number + 1, raw


BodyStop = ServiceError | web.HTTPRequestTimeout | ConnectionError
"""What ends the reading of an import's body before its end."""


@dataclass
class _Import:
    """An import in progress: the file's model and what the batches did so far."""

    model_id: str = ""
    sync: bool = False
    """Whether the import brings held rows and edges in step with the lines (sync=true)."""
    lines: int = 0
    imported: int = 0
    skipped: int = 0
    updated: int = 0
    erased: int = 0
    refused: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    last_line: int = 0
    """The number of the body's last whole line read so far."""
    stop: BodyStop | None = None
    """Why the body stopped being read before its end (a line over a limit, a silent client,
    one that hung up or broke the chunked framing)."""
    header: Header | None = None
    end: tuple[int, int] | None = None
    """The end line read last, while no line came after it: the lines it counts before it,
    and the lines that did come before it."""

    def came_before(self) -> int:
        """The lines read so far, the header's too (the count an end line next would give)."""
        return self.lines + (self.header is not None)

    def missing(self) -> str | None:
        """What the file lacks of a whole export: its end line when its header promises one
        (or another line came after it), or lines the end line counts; None if nothing."""
        if self.end is None:
            if self.header is None or not self.header.ends:
                return None  # minimal lines, or an export from before end lines
            return (
                "the export's end line is missing: the file may be cut short (a partial copy or "
                f"an interrupted download), and only its {self.lines} lines were read"
            )
        counted, came = self.end
        if counted != came:
            return (
                f"the export's end line counts {counted} lines before it, but {came} came: "
                "lines are missing from the file"
            )
        return None

    def counts(self, stopped: bool = False) -> dict[str, Any]:
        """What the reply reports: lines read, rows written or skipped, lines refused, and
        whether the import stopped part-way (its lines after the stop not read); with sync,
        rows and edges replaced and taken away too."""
        synced = {"updated": self.updated, "erased": self.erased} if self.sync else {}
        return {
            "lines": self.lines,
            "imported": self.imported,
            "skipped": self.skipped,
            **synced,
            "refused": self.refused,
            "errors": self.errors,
            "stopped": stopped,
        }

    def refuse(self, line: int, error: str) -> None:
        """Counts a bad line, listing the first few by line number (a line that is not UTF-8 is
        refused as it is read, before the store's refusals of the lines sent ahead of it)."""
        self.refused += 1
        insort(self.errors, {"line": line, "error": error}, key=lambda listed: listed["line"])
        del self.errors[MAX_LISTED_ERRORS:]


def _rows_request(
    request: web.Request, run: _Import, batch: list[store_pb2.ImportLine]
) -> store_pb2.ImportRowsRequest:
    config = request.app[CONFIG]
    return store_pb2.ImportRowsRequest(
        scope=_import_scope(request),
        lines=batch,
        model_id=run.model_id,
        extraction_status=extraction_status(config),
        write_mode=config.mode,
        actor="api",
        sync=run.sync,
    )


async def _embedded(
    request: web.Request, run: _Import, batch: list[store_pb2.ImportLine]
) -> store_pb2.EmbedImportResponse | None:
    """The store's vectors for a batch, asked for while the batch before is written; None
    when it cannot give them (the batch is then embedded as it is written)."""
    try:
        return await request.app[STORE].EmbedImport(
            _rows_request(request, run, batch), timeout=IMPORT_TIMEOUT_S
        )
    except ServiceError as exc:  # the store client raises these, never gRPC's own errors
        log.info("import: embedding ahead failed (%s: %s); the batch is embedded as written",
                 type(exc).__name__, exc.message)
        return None


async def _write(
    request: web.Request,
    run: _Import,
    batch: list[store_pb2.ImportLine],
    embedded: store_pb2.EmbedImportResponse | None,
) -> store_pb2.ImportRowsResponse:
    """One store call: the batch written in one transaction, or none of it and its bad lines."""
    rows = _rows_request(request, run, batch)
    if embedded is not None and embedded.model_id:
        rows.vectors, rows.vectors_model_id = embedded.vectors, embedded.model_id
        rows.held_lines.extend(embedded.held_lines)
    reply = await request.app[STORE].ImportRows(rows, timeout=IMPORT_TIMEOUT_S)
    run.imported += reply.imported
    run.skipped += reply.skipped
    run.updated += reply.updated
    run.erased += reply.erased
    return reply


async def _send(
    request: web.Request,
    run: _Import,
    batch: list[store_pb2.ImportLine],
    embedding: asyncio.Task[store_pb2.EmbedImportResponse | None],
) -> None:
    """One batch to the store; refused for some lines, it goes again without them until the
    store takes it (the store checks a batch in stages, its lines' form before the ids they
    name, and each refusal names the lines of one stage), so every good line is written and
    every bad one reported. A refusal that names none of the batch's lines refuses them all."""
    reply = await _write(request, run, batch, await embedding)
    while reply.errors:
        sent = {line.line for line in batch}
        named = {error.line: error.error for error in reply.errors if error.line in sent}
        if not named:
            first = reply.errors[0]
            why = f"not written: its batch was refused (line {first.line}: {first.error})"
            for line in batch:
                run.refuse(line.line, why)
            return
        for number, error in named.items():
            run.refuse(number, error)
        batch = [line for line in batch if line.line not in named]
        if not batch:
            return
        reply = await _write(request, run, batch, None)


def _import_scope(request: web.Request) -> common_pb2.Scope:
    params = Params(request.query, {})
    user_id = params.string("user_id")
    return owner_scope(user_id, params.string("agent_id")) if user_id else all_users()


async def _import_lines(
    request: web.Request, run: _Import
) -> AsyncIterator[tuple[store_pb2.ImportLine, int]]:
    """The body's lines to send, with their sizes: a first line that is an export header sets
    the model, an end line is kept to check the file is whole, and a line that is not UTF-8,
    a malformed end line or a gone line its header's version holds none of is refused here."""
    first = True
    async for number, raw in _numbered_lines(request):
        run.last_line = number
        try:
            text: str | None = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            text = None
        if first and text is not None and (found := read_header(text)) is not None:
            run.header, run.model_id = found, found.model_id
            first = False
            continue
        first = False
        counted, refused = None, None
        if text is not None:
            try:
                counted = end_count(text)
            except InvalidArgument as exc:
                refused = exc.message
            else:
                refused = gone_refused(text, run.header)
        if counted is not None:
            run.end = (counted, run.came_before())
            continue
        run.end = None  # a line after the end line: that end was not the file's
        run.lines += 1
        if text is None or refused is not None:
            # Never sent: the rest of its batch goes.
            run.refuse(number, refused or "not UTF-8 text")
            continue
        size = len(raw)
        if size > MAX_TRANSFER_LINE_BYTES:
            raise TooLarge(
                f"line {number} is {size:,} bytes; at most {MAX_TRANSFER_LINE_BYTES:,} go to "
                "the store in one call"
            )
        yield store_pb2.ImportLine(line=number, json=text), size


async def _batches(
    request: web.Request, run: _Import
) -> AsyncIterator[list[store_pb2.ImportLine]]:
    """The body's lines in batches of at most BATCH_LINES lines and TRANSFER_BUDGET_BYTES
    (a longer line goes alone). A body that stops before its end (run.stop says why) still
    gives the lines read before it, so every line counted is written, skipped or refused."""
    batch: list[store_pb2.ImportLine] = []
    batch_bytes = 0
    try:
        async for line, size in _import_lines(request, run):
            if batch and batch_bytes + size > TRANSFER_BUDGET_BYTES:
                yield batch
                batch, batch_bytes = [], 0
            batch.append(line)
            batch_bytes += size
            if len(batch) == BATCH_LINES:
                yield batch
                batch, batch_bytes = [], 0
    except (ServiceError, web.HTTPRequestTimeout, ConnectionError) as exc:
        run.stop = exc
    if batch:
        yield batch


def _stopped(request: web.Request, run: _Import, exc: BodyStop) -> web.Response:
    """The reply to an import stopped part-way (a line over a limit, a busy or failing store,
    a client that stopped sending): the batches before are written, and the counts say so, so
    a retry can skip them. A client that hung up gets no reply: the log has its counts."""
    if isinstance(exc, ServiceError):
        error, status = client_message(request, exc), exc.http_status
    elif isinstance(exc, ConnectionError):
        error, status = "the client went away", CLIENT_WENT_AWAY
        log.info("%s %s: the client went away (%s) after line %d of its body; every line read "
                 "is settled: %s", request.method, request.path, exc, run.last_line,
                 {name: value for name, value in run.counts().items() if name != "stopped"})
    else:
        error, status = http_message(request, exc), exc.status
    return json_response({**run.counts(stopped=True), "error": error}, status=status)


@routes.post("/api/v1/import")
@streams_body
async def import_jsonl(request: web.Request) -> web.Response:
    """Writes an export (or minimal memory lines) batch by batch; ids their owner holds skip,
    or with sync=true are replaced when their line differs (and gone lines applied)."""
    run = _Import(sync=Params(request.query, {}).boolean("sync", False))
    # Each batch is embedded while the one before it is written; they are written in order.
    queued: list[tuple[list[store_pb2.ImportLine], asyncio.Task[Any]]] = []
    try:
        async for batch in _batches(request, run):
            queued.append((batch, asyncio.create_task(_embedded(request, run, batch))))
            if len(queued) == 2:
                await _send(request, run, *queued.pop(0))
        while queued:
            await _send(request, run, *queued.pop(0))
    except ServiceError as exc:
        return _stopped(request, run, exc)
    finally:
        for _, embedding in queued:
            embedding.cancel()
    if run.stop is not None:
        return _stopped(request, run, run.stop)
    body = run.counts()
    problems = [f"line {run.errors[0]['line']}: {run.errors[0]['error']}"] if run.errors else []
    missing = run.missing()
    if (run.header is not None and run.header.ends) or run.end is not None:
        body["complete"] = missing is None
    if missing:
        problems.append(missing)
    if problems:
        # Like a refused line: what the file held is written, and the reply says what is not.
        body["error"] = "; ".join(problems)
        return json_response(body, status=400)
    return json_response(body)
