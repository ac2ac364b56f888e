"""One middleware that turns every failure into a JSON {"error": ...} with its HTTP status."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

from gateway.state import CONFIG
from shared.errors import ServiceError

log = logging.getLogger(__name__)

HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 413,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Unauthenticated(ServiceError):
    """The request lacks the bearer token the server requires (HTTP 401)."""

    code = grpc.StatusCode.UNAUTHENTICATED


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
    body: dict[str, Any] = {"error": message}
    body.update(getattr(request.match_info.handler, "error_extras", {}))
    return web.json_response(body, status=status, headers=headers, dumps=_dumps)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


_AIOHTTP_MESSAGES = {
    404: "not found",
    405: "method not allowed",
    413: "request body is too large",
}


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Maps ServiceError, gRPC errors and aiohttp's own HTTP errors to JSON."""
    try:
        return await handler(request)
    except ServiceError as exc:
        status = HTTP_STATUS.get(exc.code, 500)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return error_response(request, status, exc.message, headers)
    except grpc.aio.AioRpcError as exc:
        status = HTTP_STATUS.get(exc.code(), 500)
        if status == 500:
            log.error("%s %s: %s %s", request.method, request.path, exc.code().name, exc.details())
        message = exc.details() or exc.code().name.lower()
        if status == 503:
            message = f"a backing service is unavailable: {message}"
        return error_response(request, status, message)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = _AIOHTTP_MESSAGES.get(exc.status, exc.reason.lower())
        if exc.status == 413:
            limit = request.app[CONFIG].max_body_bytes
            message = f"request body is over the {limit // (1024 * 1024)} MiB limit"
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(request, exc.status, message, headers)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(request, 500, "internal error")
