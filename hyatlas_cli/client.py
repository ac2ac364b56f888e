"""The gateway over REST for the command line: JSON calls, and streams with progress bars."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
from tqdm import tqdm

from shared.errors import InvalidArgument
from shared.export_format import cut_short_reason, end_count

DEFAULT_URL = "http://127.0.0.1:19528"
CHUNK_BYTES = 1 << 16
# What of an export's start and end is kept to read its header, and its last line: the end
# line of a whole export, or one saying why it was cut short.
TAIL_BYTES = 1 << 16
# Export and import run as long as they need; only connecting is bounded.
STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10)
CALL_TIMEOUT = aiohttp.ClientTimeout(total=15 * 60, sock_connect=10)


class GatewayError(Exception):
    """The gateway refused a request or could not be reached; the message says which."""


def _checked_url(url: str) -> str:
    """A gateway's base URL without its trailing slash; one without http:// or https:// is a
    GatewayError saying so (aiohttp would take it for a relative path)."""
    if not url.startswith(("http://", "https://")):
        raise GatewayError(f"{url!r} is no gateway URL: give it as http://host:port")
    return url.rstrip("/")


class GatewayUnavailable(GatewayError):
    """The gateway did not answer, or answered 503: it may answer again soon."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """How long the gateway asked to be left alone, when it said."""


@dataclass(frozen=True)
class Gateway:
    """Where the gateway listens and the bearer token it wants (HYATLAS_TOKEN), if any."""

    url: str = DEFAULT_URL
    token: str = ""

    @classmethod
    def from_env(cls, url: str = "", environ: Mapping[str, str] = os.environ) -> Gateway:
        """The gateway the flags or HYATLAS_SERVER_URL and HYATLAS_TOKEN name."""
        base = url or environ.get("HYATLAS_SERVER_URL", "").strip() or DEFAULT_URL
        return cls(_checked_url(base), environ.get("HYATLAS_TOKEN", "").strip())

    @classmethod
    def target(cls, url: str, environ: Mapping[str, str] = os.environ) -> Gateway:
        """The gateway a migration writes to, with its own token (HYATLAS_TO_TOKEN): the
        source's is never sent to another server."""
        return cls(_checked_url(url), environ.get("HYATLAS_TO_TOKEN", "").strip())

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def call(
        self, method: str, path: str, params: Mapping[str, str] | None = None
    ) -> tuple[int, Any]:
        """One request: its status and its JSON body."""
        status, body, _ = await self._request(method, path, params)
        return status, body

    async def ok(self, method: str, path: str, params: Mapping[str, str] | None = None) -> Any:
        """The JSON body of a request that must succeed; a 503 is GatewayUnavailable."""
        status, body, retry_after_s = await self._request(method, path, params)
        if status == 503:
            raise GatewayUnavailable(refusal(status, body), retry_after_s)
        if status >= 400:
            raise GatewayError(refusal(status, body))
        return body

    async def _request(
        self, method: str, path: str, params: Mapping[str, str] | None
    ) -> tuple[int, Any, float | None]:
        """One request: its status, its JSON body and its Retry-After in seconds, if any."""
        try:
            async with (
                aiohttp.ClientSession(timeout=CALL_TIMEOUT, headers=self._headers()) as session,
                session.request(method, self.url + path, params=params) as reply,
            ):
                retry_after = reply.headers.get("Retry-After", "")
                # Seconds only: an HTTP date is left to the caller's own pause.
                retry_after_s = float(retry_after) if retry_after.isdigit() else None
                return reply.status, await _json_of(reply), retry_after_s
        except aiohttp.ClientError as exc:
            raise GatewayUnavailable(f"cannot reach the gateway at {self.url}: {exc}") from None

    async def export_to(self, out: IO[bytes], params: Mapping[str, str]) -> int:
        """Streams an export into out with a progress bar; returns its memory and edge lines. An
        export cut short is a GatewayError, naming the reason when the server's last line gives
        it, and so is one that ends without the end line its header promises."""
        lines, head, tail = 0, b"", b""
        try:
            async with (
                aiohttp.ClientSession(timeout=STREAM_TIMEOUT, headers=self._headers()) as session,
                session.get(self.url + "/api/v1/export", params=params) as reply,
            ):
                if reply.status >= 400:
                    raise GatewayError(refusal(reply.status, await _json_of(reply)))
                with _bar("export", None) as bar:
                    async for chunk in reply.content.iter_chunked(CHUNK_BYTES):
                        out.write(chunk)
                        lines += chunk.count(b"\n")
                        bar.update(len(chunk))
                        tail = (tail + chunk)[-TAIL_BYTES:]
                        if len(head) < TAIL_BYTES and b"\n" not in head:
                            head = (head + chunk)[:TAIL_BYTES]
        except aiohttp.ClientError as exc:
            why = _cut_short(tail) or exc
            raise GatewayError(f"export from {self.url} failed: {why}") from None
        return self._whole(lines, head, tail)

    def _whole(self, lines: int, head: bytes, tail: bytes) -> int:
        """The memory and edge lines of an export that ended: all but its header and end line
        (an older server's export has none); a GatewayError when its header promises an end
        line and the last line is not one that counts the lines before it."""
        first, last = _json_line(head.partition(b"\n")[0]), tail.rstrip(b"\n").rpartition(b"\n")[2]
        try:
            counted = end_count(last.decode("utf-8", "replace"))
        except InvalidArgument:
            counted = None
        if counted is not None and counted == lines - 1:
            return lines - 2
        if isinstance(first, dict) and first.get("end_line") is True:
            raise GatewayError(
                f"export from {self.url} is incomplete: its last line is not the end line "
                "counting the lines before it"
            )
        return max(lines - 1, 0)

    async def import_from(self, path: Path, params: Mapping[str, str]) -> tuple[int, Any]:
        """Streams a JSONL file to the import route with a progress bar; status and reply."""
        size = (await asyncio.to_thread(path.stat)).st_size
        try:
            async with aiohttp.ClientSession(
                timeout=STREAM_TIMEOUT, headers=self._headers()
            ) as session:
                with _bar("import", size) as bar:
                    async with session.post(
                        self.url + "/api/v1/import", params=params, data=_read(path, bar)
                    ) as reply:
                        return reply.status, await _json_of(reply)
        except aiohttp.ClientError as exc:
            raise GatewayError(f"import into {self.url} failed: {exc}") from None

    async def copy_to(self, target: Gateway) -> tuple[int, Any]:
        """Streams this gateway's export of every owner, with what is gone from it, into
        target's import as it arrives, syncing (rows and edges that changed are replaced,
        rows deleted and edges undone here are there too), with a progress bar counting
        lines; the import's status and reply."""
        try:
            async with (
                aiohttp.ClientSession(timeout=STREAM_TIMEOUT, headers=self._headers()) as source,
                aiohttp.ClientSession(timeout=STREAM_TIMEOUT, headers=target._headers()) as sink,
                source.get(self.url + "/api/v1/export", params={"gone": "true"}) as exported,
            ):
                if exported.status >= 400:
                    body = await _json_of(exported)
                    raise GatewayError(f"export from {self.url}: {refusal(exported.status, body)}")
                with _lines_bar("migrate") as bar:
                    async with sink.post(
                        target.url + "/api/v1/import",
                        params={"sync": "true"},
                        data=_counted(exported.content, bar),
                    ) as reply:
                        body = await _json_of(reply)
        except aiohttp.ClientError as exc:
            raise GatewayError(
                f"migration from {self.url} to {target.url} cut short ({exc}); run it again: "
                "rows already moved are skipped, or replaced where they changed since"
            ) from None
        if reply.status >= 400 and not (isinstance(body, dict) and "errors" in body):
            raise GatewayError(f"import into {target.url}: {import_refusal(reply.status, body)}")
        return reply.status, body


async def _json_of(reply: aiohttp.ClientResponse) -> Any:
    """A reply's JSON body; one that is not JSON (another service at the URL, a proxy's error
    page) is a GatewayError saying so."""
    text = await reply.text(errors="replace")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        start = " ".join(text.split())[:60]
        raise GatewayError(
            f"{reply.url.origin()} answered HTTP {reply.status} with no JSON ({start!r}): "
            "is that the HyAtlas gateway (--url, HYATLAS_SERVER_URL)?"
        ) from None


def _json_line(line: bytes) -> Any:
    """A line's JSON value; None when it is no JSON."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def _cut_short(tail: bytes) -> str | None:
    """Why the server cut an export short, when the last line received says so."""
    try:
        reason = cut_short_reason(json.loads(tail.rstrip(b"\n").rpartition(b"\n")[2]))
    except (ValueError, RecursionError):  # a line cut in the middle, or no line at all
        return None
    return None if reason is None else f"cut short by the server: {reason} (the output ends there)"


async def _counted(content: aiohttp.StreamReader, bar: tqdm[Any]) -> AsyncIterator[bytes]:
    async for chunk in content.iter_chunked(CHUNK_BYTES):
        bar.update(chunk.count(b"\n"))
        yield chunk


async def _read(path: Path, bar: tqdm[Any]) -> AsyncIterator[bytes]:
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            bar.update(len(chunk))
            yield chunk


def _bar(what: str, total: int | None) -> tqdm[Any]:
    return tqdm(total=total, desc=what, unit="B", unit_scale=True, file=sys.stderr)


def _lines_bar(what: str) -> tqdm[Any]:
    return tqdm(desc=what, unit=" lines", unit_scale=True, file=sys.stderr)


def progress_bar(what: str, total: int | None) -> tqdm[Any]:
    """A bar counting rows on stderr (a count alone without a total)."""
    return tqdm(total=total, desc=what, unit="rows", file=sys.stderr)


def note(line: str) -> None:
    """A line on stderr above a progress bar, which is drawn again below it."""
    tqdm.write(line, file=sys.stderr)


def refusal(status: int, body: Any) -> str:
    """A refused request in one line: its status and the server's words."""
    message = body.get("error") if isinstance(body, dict) else None
    return f"HTTP {status}: {message or body}"


# What a server from before gone lines says of an export that has them (it reads version 1
# alone), and what it means.
OLDER_SERVER = "export version 2 is not 1"
OLDER_SERVER_HINT = (
    " (that server predates gone lines and syncing imports, which an export of version 2 "
    "holds: upgrade it; an export without --gone still imports there)"
)


def import_refusal(status: int, body: Any) -> str:
    """A refused import in one line; one refused by a server too old for its gone lines says
    so."""
    said = refusal(status, body)
    return said + OLDER_SERVER_HINT if OLDER_SERVER in said else said
