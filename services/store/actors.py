"""Who a change is recorded as: the calling service, or for the API the client it came from."""

from __future__ import annotations

# A client's write_origin values that mean the Hermes plugin wrote (sync_turn, its memory tool).
PLUGIN_ORIGINS = frozenset({"plugin", "memory_tool", "sync_turn"})
API = "api"
DASHBOARD = "dashboard"


def actor_for(caller: str, origin: str) -> str:
    """The audit actor of a change: the calling service (api, extractor, consolidator), except
    that an API change the plugin or the dashboard made is theirs."""
    caller = caller or API
    if caller != API:
        return caller
    if origin in PLUGIN_ORIGINS:
        return "plugin"
    return DASHBOARD if origin == DASHBOARD else API
