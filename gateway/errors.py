"""One middleware that turns every failure into a JSON {"error": ...} with its HTTP status."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from gateway.state import CONFIG
from shared.errors import (
    Overloaded,
    ServiceError,
    StorageFull,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from shared.settings import SERVICES

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_extras(**extras: Any) -> Callable[[Handler], Handler]:
    """Marks a route whose error bodies carry extra keys (e.g. success=false on add)."""

    def mark(handler: Handler) -> Handler:
        handler.error_extras = extras  # type: ignore[attr-defined]
        return handler

    return mark


def error_response(
    request: web.Request, status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON error body with the route's extra keys."""
    extras = getattr(request.match_info.handler, "error_extras", {})
    return json_error(status, message, headers, **extras)


def json_error(
    status: int, message: str, headers: dict[str, str] | None = None, **extras: Any
) -> web.Response:
    """The shape of every error answer: {"error": message} and any extra keys."""
    return web.json_response(
        {"error": message, **extras}, status=status, headers=headers, dumps=_dumps
    )


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


UNSUPPORTED_ENCODING = (
    "unsupported Content-Encoding: send the body as gzip or deflate, or unencoded"
)
"""What a client sending a body in another Content-Encoding is told: the gateway's parser
refuses br and zstd (they would need a decoder package that is not installed), the body reader
any coding it does not know (read_timeouts)."""

CLIENT_WENT_AWAY = 499
"""The status a request whose client hung up part-way is logged with (no answer reaches it)."""

_AIOHTTP_MESSAGES = {
    404: "not found",
    405: "method not allowed",
    413: "request body is too large",
    415: UNSUPPORTED_ENCODING,
}


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Maps ServiceErrors (of this process or a backing service) and aiohttp's errors to JSON."""
    try:
        return await handler(request)
    except ServiceError as exc:
        return _service_error(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(request, exc.status, http_message(request, exc), headers)
    except ConnectionError as exc:
        if not _client_gone(request):
            return _unexpected(request)
        # The client hung up part-way (an export read in part, an import's body cut short):
        # nothing failed here, and no answer reaches it (499, as nginx logs such a request).
        log.info("%s %s: the client went away (%s)", request.method, request.path, exc)
        return error_response(request, CLIENT_WENT_AWAY, "the client went away")
    except Exception:
        return _unexpected(request)


def _client_gone(request: web.Request) -> bool:
    """Whether the client's connection is closed or closing."""
    return request.transport is None or request.transport.is_closing()


def _unexpected(request: web.Request) -> web.Response:
    """A 500 telling the client only a reference; the traceback goes to the log with it."""
    error_id = new_error_id()
    log.exception("%s %s failed (error id %s)", request.method, request.path, error_id)
    return error_response(request, 500, internal_message(error_id))


def http_message(request: web.Request, exc: web.HTTPException) -> str:
    """What a client is told of one of aiohttp's HTTP errors (a 4xx it raised or we did)."""
    if exc.status == 413:
        limit = request.app[CONFIG].max_body_bytes
        return f"request body is over the {limit // (1024 * 1024)} MiB limit"
    return _AIOHTTP_MESSAGES.get(exc.status, exc.reason.lower())


def new_error_id() -> str:
    """A short reference that ties a client's 500 to its log line."""
    return uuid.uuid4().hex[:12]


def internal_message(error_id: str) -> str:
    """All a client learns of an unexpected failure: that it happened, and its reference."""
    return f"internal error (id {error_id})"


def client_message(request: web.Request, exc: ServiceError) -> str:
    """What a client is told of a ServiceError; an unexpected one's words go to the log only."""
    message = exc.message
    if isinstance(exc, Overloaded):
        # Work queued ahead of it (the embedder's queue): the service is up, and a retry after
        # Retry-After may pass; the log says whose queue.
        log.warning("%s %s: %s", request.method, request.path, message)
        whose = exc.service or "a service"
        message = f"server busy: {whose} has too much work queued; retry shortly"
    elif isinstance(exc, Unavailable) and exc.service:
        # gRPC's words name sockets and addresses: the client learns which service, the log why.
        log.warning("%s %s: %s", request.method, request.path, message)
        message = f"a backing service is unavailable: {_unreachable(exc.service, message)}"
    elif isinstance(exc, Unavailable):
        message = f"a backing service is unavailable: {message}"
    elif isinstance(exc, StorageFull):
        # Its words say what to do and go to the client; the operator reads them here.
        log.warning("%s %s refused: %s", request.method, request.path, message)
    elif exc.http_status >= 500 and not isinstance(exc, (Unimplemented, StorageFull)):
        # A backing service's own words may hold exception text: they go to the log only.
        error_id = new_error_id()
        log.error("%s %s: %s (error id %s)", request.method, request.path, message, error_id)
        message = internal_message(error_id)
    return message


def _unreachable(called: str, message: str) -> str:
    """The service out of reach, named through the ones the call went by: a service passes on
    the failure of one it called as "<name>: <its words>" ("store: embedder: failed to
    connect" is the embedder, through the store)."""
    chain = [called]
    while (name := message.partition(": ")[0]) in SERVICES:
        if name != chain[-1]:
            chain.append(name)
        message = message.partition(": ")[2]
    if len(chain) == 1:
        return called
    through = " and ".join(f"the {name}" for name in reversed(chain[:-1]))
    return f"{chain[-1]} (called through {through})"


def _service_error(request: web.Request, exc: ServiceError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthenticated) else None
    return error_response(request, exc.http_status, client_message(request, exc), headers)
