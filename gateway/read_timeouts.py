"""Request bodies: one must come in an encoding the gateway reads, and arrive within
HYATLAS_BODY_TIMEOUT (slow clients; the head's limit is the server's keep-alive timeout, set
from HYATLAS_HEADER_TIMEOUT in __main__)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import hdrs, web

from gateway.state import CONFIG
from shared.errors import InvalidArgument

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def streams_body(handler: Handler) -> Handler:
    """Marks a route that reads its body as it goes (through body_chunks), not in one piece."""
    handler.streams_body = True  # type: ignore[attr-defined]
    return handler


def _too_slow(timeout_s: float) -> web.HTTPRequestTimeout:
    # aiohttp closes the connection after this answer, since the body was not read to its end.
    return web.HTTPRequestTimeout(reason=f"Request body not received within {timeout_s:g}s")


READ_ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})
"""The Content-Encodings a body may come in: aiohttp decodes gzip and deflate (its parser refuses
br and zstd, parser_errors), and would pass a body of a coding it does not know on as it is."""


def _bad_body(exc: web.RequestPayloadError) -> InvalidArgument:
    # aiohttp words it "400, message:\n  Can not decode content-encoding: gzip": the last line.
    return InvalidArgument(f"bad body: {str(exc).splitlines()[-1].strip()}")


_BROKEN = web.RequestKey("body_broken", str)
"""Why the HTTP parser stopped reading a request's body part-way, if it did."""


def break_body(request: web.BaseRequest, why: str) -> None:
    """Ends a body the HTTP parser could not read on (its chunked framing broke): the route
    reads what arrived before the break, then a refusal saying why."""
    request[_BROKEN] = why.strip().rstrip(":")
    request.content.feed_eof()


def _check_whole(request: web.BaseRequest) -> None:
    """Refuses a body that ended where its framing broke, not at its end."""
    if _BROKEN in request:
        raise InvalidArgument(f"bad body: {request[_BROKEN]}")


@web.middleware
async def body_timeout_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuses a body in an encoding the gateway does not read (415), then reads a body in
    full, within the timeout, before the route sees it (read() keeps it)."""
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "").lower()
    if request.body_exists and encoding not in READ_ENCODINGS:
        raise web.HTTPUnsupportedMediaType()
    streaming = getattr(request.match_info.handler, "streams_body", False)
    if request.body_exists and not streaming:
        timeout_s = request.app[CONFIG].body_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await request.read()  # over client_max_size: aiohttp raises 413 here
        except TimeoutError:
            raise _too_slow(timeout_s) from None
        except web.RequestPayloadError as exc:  # a body that does not decode as its encoding
            raise _bad_body(exc) from None
        _check_whole(request)
    return await handler(request)


async def body_chunks(request: web.Request, size: int) -> AsyncIterator[bytes]:
    """A streamed body in chunks of at most size as they arrive; a wait of more than the
    timeout for the next one ends the request with 408."""
    timeout_s = request.app[CONFIG].body_timeout_s
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                chunk = await request.content.read(size)
        except TimeoutError:
            raise _too_slow(timeout_s) from None
        except web.RequestPayloadError as exc:
            raise _bad_body(exc) from None
        if not chunk:
            _check_whole(request)
            return
        yield chunk
