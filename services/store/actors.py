"""Who a change is recorded as: the calling service, or for the API the client it came from."""

from __future__ import annotations

from shared.limits import check_name

# A client's write_origin values that mean the Hermes plugin wrote (sync_turn, its memory tool).
PLUGIN_ORIGINS = frozenset({"plugin", "memory_tool", "sync_turn"})
API = "api"
DASHBOARD = "dashboard"


def actor_for(caller: str, origin: str, token_name: str = "") -> str:
    """The audit actor of a change: the calling service (api, extractor, consolidator); for an
    API change, the name of the token it came with, else the client it says it is (plugin,
    dashboard): a named token is who called, what the client declares is not. A caller's own
    name is held to a name's limits, as an import of its audit entries holds it."""
    caller = caller or API
    if caller != API:
        return check_name("actor", caller)
    if token_name:
        return token_name
    if origin in PLUGIN_ORIGINS:
        return "plugin"
    return DASHBOARD if origin == DASHBOARD else API


def named_actor(actor: str, token_name: str) -> str:
    """The actor of a call that names its own: a gateway call's is its token's name, if any."""
    return token_name if token_name and actor in ("", API) else check_name("actor", actor)
