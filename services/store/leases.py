"""Leases: a name held by one holder until a time, so that replicas of a service take turns."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from services.store.core import Core
from shared.errors import InvalidArgument
from shared.leases import LEASE_NAME_MAX, LEASE_TTL_MAX_S
from shared.limits import check_name, check_no_nul

PREFIX = "lease/"
"""Leases live in the state table under this prefix, beside the consolidator's state."""
ACTOR = "lease"


@dataclass(frozen=True)
class Lease:
    """The answer to a claim: whether the claimer holds the lease, and who does until when."""

    granted: bool
    holder: str = ""
    expires_at: float = 0.0


async def claim(core: Core, name: str, holder: str, ttl_s: float) -> Lease:
    """Grants the lease when it is free, expired or the holder's own (a renewal), for ttl_s
    from now; ttl_s 0 releases the holder's lease. Refused while another holder has it."""
    _check(name, holder, ttl_s)
    key = PREFIX + name
    async with core.writing(ACTOR) as w:
        # A committed read is enough: every write transaction (of every replica, on either
        # backend) takes the write lock, so nothing changes the lease between it and our write.
        held_by, until = _stored(await core.repo.get_state(key), key)
        if held_by and held_by != holder and until > w.now:
            return Lease(False, held_by, until)
        if ttl_s == 0:
            if held_by == holder:
                await w.tx.set_state(key, "", w.now)
            return Lease(True)
        granted = Lease(True, holder, w.now + ttl_s)
        value = {"holder": holder, "expires_at": granted.expires_at}
        await w.tx.set_state(key, json.dumps(value), w.now)
        return granted


def _check(name: str, holder: str, ttl_s: float) -> None:
    if not name or len(name) > LEASE_NAME_MAX:
        raise InvalidArgument(f"a lease name is 1 to {LEASE_NAME_MAX} characters")
    check_no_nul("lease name", name)
    if not holder:
        raise InvalidArgument("holder is required")
    check_name("holder", holder)
    if not (math.isfinite(ttl_s) and 0 <= ttl_s <= LEASE_TTL_MAX_S):
        raise InvalidArgument(
            f"ttl_s {ttl_s} is not a duration of 0 to {LEASE_TTL_MAX_S:,.0f} seconds"
        )


def _stored(values: list[tuple[str, str]], key: str) -> tuple[str, float]:
    """The holder and expiry stored under key, or ("", 0) (state reads go by prefix, so
    longer names under it are skipped)."""
    for found, value in values:
        if found == key:
            stored = json.loads(value)
            return str(stored["holder"]), float(stored["expires_at"])
    return "", 0.0
