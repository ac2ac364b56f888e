"""Who has memories: each owner (user, agent) with live and retired row counts and last write."""

from __future__ import annotations

from dataclasses import dataclass

from services.store.model import ACTIVE, Reach
from services.store.repo import Repo


@dataclass(frozen=True)
class OwnerCount:
    """One owner's rows."""

    user_id: str
    agent_id: str
    live: int
    retired: int
    last_write_at: float


async def list_owners(repo: Repo, reach: Reach) -> list[OwnerCount]:
    """Every owner with rows in the reach, most recently written first."""
    where, owned = reach.sql()
    params = [ACTIVE, ACTIVE, *owned]
    rows = await repo.reader.execute_fetchall(
        "SELECT user_id, agent_id, sum(status = ?), sum(status != ?), max(created_at) "
        f"FROM memories {'WHERE ' + ' AND '.join(where) if where else ''} "
        "GROUP BY user_id, agent_id ORDER BY max(created_at) DESC, user_id, agent_id",
        params,
    )
    return [OwnerCount(user, agent, int(live), int(retired), float(last))
            for user, agent, live, retired, last in rows]
