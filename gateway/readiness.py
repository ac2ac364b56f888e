"""Liveness (/healthz), readiness (/readyz) and the short wait of a write made during start-up."""

from __future__ import annotations

import asyncio

import grpc
from aiohttp import web

from gateway.state import CHANNELS, CONFIG
from shared.errors import Unavailable
from shared.rpc import health_state
from shared.settings import BACKGROUND_SERVICES, MODE_SERVICES

HEALTH_TIMEOUT_S = 2.0

routes = web.RouteTableDef()


async def service_states(app: web.Application) -> dict[str, str]:
    """gRPC health of every backing service of the mode, asked at once: serving, not_serving,
    unreachable."""
    channels = app[CHANNELS]
    states = await asyncio.gather(
        *(health_state(channel, HEALTH_TIMEOUT_S) for channel in channels.values())
    )
    return dict(zip(channels, states, strict=True))


def is_ready(states: dict[str, str], mode: str) -> bool:
    """Whether every service the mode's writes and searches need is serving (the background
    ones are left out: a consolidator away only makes the slow path wait)."""
    return all(
        states.get(name) == "serving"
        for name in MODE_SERVICES[mode]
        if name not in BACKGROUND_SERVICES
    )


def all_serving(states: dict[str, str]) -> bool:
    """Whether every service asked is serving (the background ones too)."""
    return all(state == "serving" for state in states.values())


async def wait_for_store(app: web.Application) -> None:
    """Waits up to HYATLAS_STARTUP_WAIT for the store's channel to connect (start-up writes)."""
    channel = app[CHANNELS]["store"]
    if channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
        return
    wait_s = app[CONFIG].startup_wait_s
    try:
        await asyncio.wait_for(channel.channel_ready(), wait_s)
    except TimeoutError:
        raise Unavailable(
            f"the store did not answer within {wait_s:g}s; it may still be starting"
        ) from None


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    """Liveness: answers without touching any other service."""
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 once every backing service the mode needs answers, else 503."""
    states = await service_states(request.app)
    ready = is_ready(states, request.app[CONFIG].mode)
    return web.json_response(
        {"status": "ready" if ready else "not_ready", "ready": ready, "services": states},
        status=200 if ready else 503,
    )
