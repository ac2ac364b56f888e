"""Who has memories: each owner (user, agent) with live and retired row counts and last write."""

from __future__ import annotations

from dataclasses import dataclass

from services.store.model import Reach
from services.store.rows import Rows


@dataclass(frozen=True)
class OwnerCount:
    """One owner's rows."""

    user_id: str
    agent_id: str
    live: int
    retired: int
    last_write_at: float


async def list_owners(repo: Rows, reach: Reach) -> list[OwnerCount]:
    """Every owner with rows in the reach, most recently written first."""
    return [OwnerCount(*counts) for counts in await repo.owner_counts(reach)]
