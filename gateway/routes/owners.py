"""The owners the caller may see: users and agents with row counts and their last write."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

from gateway.respond import all_users, json_response, request_params, rpc_timeout
from gateway.state import STORE
from shared.dates import rfc3339
from shared.pb import common_pb2, store_pb2

routes = web.RouteTableDef()


def _counts(owners: Sequence[store_pb2.OwnerCount]) -> dict[str, Any]:
    return {
        "live": sum(o.live for o in owners),
        "retired": sum(o.retired for o in owners),
        "last_write_at": rfc3339(max(o.last_write_at for o in owners)),
    }


@routes.get("/api/v1/owners")
async def owners(request: web.Request) -> web.Response:
    """Every user with rows and each of its agents, newest write first; `user_id` picks one.

    The store narrows "every user" to the owners the caller's token grants.
    """
    params = await request_params(request)
    user_id = params.string("user_id")
    scope = common_pb2.Scope(user_id=user_id) if user_id else all_users()
    reply = await request.app[STORE].ListOwners(
        store_pb2.ListOwnersRequest(scope=scope), timeout=rpc_timeout(request)
    )
    by_user: dict[str, list[store_pb2.OwnerCount]] = {}
    for owner in reply.owners:
        by_user.setdefault(owner.user_id, []).append(owner)
    users = [
        {
            "user_id": user,
            **_counts(agents),
            "agents": [{"agent_id": a.agent_id, **_counts([a])} for a in agents],
        }
        for user, agents in by_user.items()
    ]
    return json_response({"users": users})
