"""State keys of one owner: values the server keeps for an owner, which a caller reaching that
owner may set (every other state key is the server's own)."""

from __future__ import annotations

from shared.leases import lease_name

NOW_ASKED = "now_asked"
"""The state keys of Now page rebuilds asked for and not done yet, one an owner (its ids and
when the rebuild is due in the value): a restart, even after a kill -9, does them."""

OWNER_KINDS = (NOW_ASKED,)
"""The kinds of state key an owner has; no other key is an owner's."""


def owner_key(kind: str, user_id: str, agent_id: str) -> str:
    """The state key of kind for one owner."""
    return lease_name(kind, user_id, agent_id)


def is_owners_key(key: str, user_id: str, agent_id: str) -> bool:
    """Whether key is a state key of the owner (user_id, agent_id)."""
    return any(key == owner_key(kind, user_id, agent_id) for kind in OWNER_KINDS)
