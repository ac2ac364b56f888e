"""Admission: a bound on API requests in flight, and a Retry-After on every 503."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.errors import error_response
from gateway.state import CONFIG

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

RETRY_AFTER_S = 1
"""What a 503 tells a client to wait before it tries again."""
ADMITTED_PREFIXES = ("/api/", "/dashboard/api/")
"""Routes that do work in the backing services; health, metrics and static files pass freely."""


class _Slot:
    """One request's place among those in flight; giving it back twice is harmless."""

    def __init__(self, slots: asyncio.Semaphore) -> None:
        self._slots: asyncio.Semaphore | None = slots

    def release(self) -> None:
        if self._slots is not None:
            self._slots.release()
            self._slots = None


_SLOTS = web.AppKey("admission_slots", asyncio.Semaphore)
_SLOT = web.RequestKey("admission_slot", _Slot)


async def _admitted(slots: asyncio.Semaphore, wait_s: float) -> _Slot | None:
    """A slot, or None if none came free within wait_s."""
    try:
        async with asyncio.timeout(wait_s):
            await slots.acquire()
    except TimeoutError:
        return None
    return _Slot(slots)


def leave(request: web.Request) -> None:
    """Gives the request's slot back before a long wait that costs this machine nothing (a
    write waiting for its LLM extraction), so it does not hold back other requests."""
    slot = request.get(_SLOT)
    if slot is not None:
        slot.release()


def _busy(request: web.Request) -> web.StreamResponse:
    limit = request.app[CONFIG].max_in_flight
    return error_response(
        request, 503, f"server busy: {limit} requests in flight already; retry shortly"
    )


@web.middleware
async def admission_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Past HYATLAS_MAX_IN_FLIGHT API requests a request waits up to HYATLAS_QUEUE_WAIT for a
    slot, then gets 503; every 503 tells the client when to come back."""
    if not request.path.startswith(ADMITTED_PREFIXES):
        response = await handler(request)
    elif (slot := await _admitted(request.app[_SLOTS], request.app[CONFIG].queue_wait_s)) is None:
        response = _busy(request)
    else:
        request[_SLOT] = slot
        try:
            response = await handler(request)
        finally:
            slot.release()
    if response.status == 503 and not response.prepared:
        response.headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    return response


def register(app: web.Application) -> None:
    """Gives the app its slots (one per request allowed in flight)."""
    app[_SLOTS] = asyncio.Semaphore(app[CONFIG].max_in_flight)
