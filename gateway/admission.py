"""Admission: a bound on API requests in flight, and a Retry-After on every 503."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from gateway.errors import error_response
from gateway.state import CONFIG

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

RETRY_AFTER_S = 1
"""What a 503 tells a client to wait before it tries again."""
ADMITTED_PREFIXES = ("/api/", "/dashboard/api/")
"""Routes that do work in the backing services; health, metrics and static files pass freely."""

_SLOTS = web.AppKey("admission_slots", asyncio.Semaphore)


@contextlib.asynccontextmanager
async def _slot(slots: asyncio.Semaphore, wait_s: float) -> AsyncIterator[bool]:
    """Holds one slot while the block runs; yields False if none came free within wait_s."""
    try:
        async with asyncio.timeout(wait_s):
            await slots.acquire()
    except TimeoutError:
        yield False
        return
    try:
        yield True
    finally:
        slots.release()


def _busy(request: web.Request) -> web.StreamResponse:
    limit = request.app[CONFIG].max_in_flight
    return error_response(
        request, 503, f"server busy: {limit} requests in flight already; retry shortly"
    )


@web.middleware
async def admission_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Past HYATLAS_MAX_IN_FLIGHT API requests a request waits up to HYATLAS_QUEUE_WAIT for a
    slot, then gets 503; every 503 tells the client when to come back."""
    if request.path.startswith(ADMITTED_PREFIXES):
        async with _slot(request.app[_SLOTS], request.app[CONFIG].queue_wait_s) as admitted:
            response = await handler(request) if admitted else _busy(request)
    else:
        response = await handler(request)
    if response.status == 503 and not response.prepared:
        response.headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    return response


def register(app: web.Application) -> None:
    """Gives the app its slots (one per request allowed in flight)."""
    app[_SLOTS] = asyncio.Semaphore(app[CONFIG].max_in_flight)
