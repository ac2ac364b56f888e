"""What the routes share: JSON out, parameters in, the owner's scope and the RPC timeout."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from gateway.params import Params, read_body
from gateway.state import CONFIG
from shared.grants import current_grant
from shared.layers import parse_layer
from shared.pb import common_pb2

DEFAULT_USER = "default"
INT32_MIN = -(2**31)

Route = TypeVar("Route", bound=Callable[[web.Request], Awaitable[web.StreamResponse]])


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON response that keeps non-ASCII text as it is."""
    return web.json_response(
        body, status=status, headers=headers, dumps=lambda v: json.dumps(v, ensure_ascii=False)
    )


async def request_params(request: web.Request, *, query_wins: bool = False) -> Params:
    """The query string and the JSON body as one set of parameters."""
    return Params(request.query, await read_body(request), query_wins=query_wins)


def _only(names: frozenset[str] | None) -> str:
    """The one name a grant's list holds; "" for any name or several."""
    return next(iter(names)) if names is not None and len(names) == 1 else ""


def default_user() -> str:
    """The user a request naming none acts for: its token's one user, else "default"."""
    grant = current_grant()
    return (_only(grant.users) if grant is not None else "") or DEFAULT_USER


def default_agent() -> str:
    """The agent a request naming none acts for: its token's one agent, else none ("")."""
    grant = current_grant()
    return _only(grant.agents) if grant is not None else ""


def owner_scope(user_id: str, agent_id: str = "") -> common_pb2.Scope:
    """One owner's scope; no user_id means the default user, no agent_id the default agent."""
    return common_pb2.Scope(user_id=user_id or default_user(), agent_id=agent_id or default_agent())


def all_users() -> common_pb2.Scope:
    """The scope of every owner."""
    return common_pb2.Scope(all_users=True)


def layer_filter(text: str) -> list[Any]:
    """The layer filter a `layer` parameter names; empty or "*" means every layer."""
    return [] if text in ("", "*") else [parse_layer(text)]


def writes(handler: Route) -> Route:
    """Marks a route that changes rows: its calls get the write deadline, not the read one."""
    handler.writes = True  # type: ignore[attr-defined]
    return handler


def rpc_timeout(request: web.Request) -> float:
    """How long a route waits for one call to a backing service: HYATLAS_WRITE_DEADLINE for a
    route marked `writes`, HYATLAS_READ_DEADLINE for any other."""
    config = request.app[CONFIG]
    if getattr(request.match_info.handler, "writes", False):
        return config.write_deadline_s
    return config.rpc_timeout_s
