"""Routes a later issue builds: they answer 501 and say which one."""

from __future__ import annotations

from aiohttp import web

from gateway.errors import Handler
from shared.errors import Unimplemented

NOT_YET: dict[str, str] = {
    "/api/v1/export": "JSONL export comes in a later issue",
    "/api/v1/import": "JSONL import comes in a later issue",
}


def _not_yet(path: str) -> Handler:
    message = f"{path} is not implemented yet: {NOT_YET[path]}"

    async def handler(request: web.Request) -> web.Response:
        raise Unimplemented(message)

    return handler


def add_placeholder_routes(app: web.Application) -> None:
    """Routes a later issue builds answer 501 and say which one."""
    for path in NOT_YET:
        app.router.add_route("*", path, _not_yet(path))
