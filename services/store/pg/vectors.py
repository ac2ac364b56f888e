"""Nearest-neighbour search in pgvector (rows.Vectors): HNSW, or exact for a small owner.

A user's keys are the `vectors` table's keys (a row's own vector) and CLAUSE_KEY_OFFSET plus
the `memory_keys` table's keys (its clause vectors), as in the SQLite store's usearch indexes.
Both tables carry the owner, so every statement reads one user's rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.store.index import IndexChanges, Matches
from services.store.pg.db import Database, numbered
from services.store.repo import CLAUSE_KEY_OFFSET

# HNSW keeps at most this many candidates per search (pgvector's limit on hnsw.ef_search);
# an iterative scan goes on past it while the owner filter leaves too few.
_EF_SEARCH_MAX = 1000
_EF_SEARCH_MIN = 40

# How many keys a user has, counted no further than a bound in each table: a search only needs
# to know whether there are none, few enough to score all, or more than it asks for, and a count
# of every key would read the whole owner (over half a million index entries at 100,000 rows).
_SIZE_UP_TO = (
    "SELECT (SELECT count(*) FROM (SELECT 1 FROM vectors WHERE user_id = ? LIMIT ?) own) "
    "+ (SELECT count(*) FROM (SELECT 1 FROM memory_keys "
    "WHERE user_id = ? AND vector IS NOT NULL LIMIT ?) clause)"
)

# Ordered by the score, not by the distance operator: an HNSW index can give only the latter,
# so the planner scans the owner's rows (the user_id indexes) and sorts them, exactly.
_EXACT = (
    "SELECT key, 1 - (vector <=> ?) AS score FROM vectors WHERE user_id = ? "
    "UNION ALL "
    "SELECT ? + key, 1 - (vector <=> ?) FROM memory_keys "
    "WHERE user_id = ? AND vector IS NOT NULL "
    "ORDER BY score DESC LIMIT ?"
)

# Ordered by the distance operator, so each table's HNSW index answers; the iterative scan
# goes on until enough of the owner's keys pass the filter. Relaxed order: sorted after.
_APPROXIMATE = (
    "(SELECT key, 1 - (vector <=> ?) AS score FROM vectors WHERE user_id = ? "
    "ORDER BY vector <=> ? LIMIT ?) "
    "UNION ALL "
    "(SELECT ? + key, 1 - (vector <=> ?) FROM memory_keys "
    "WHERE user_id = ? AND vector IS NOT NULL ORDER BY vector <=> ? LIMIT ?)"
)

_VECTORS = (
    "SELECT key, vector FROM vectors WHERE user_id = ? AND key = ANY(?::bigint[]) "
    "UNION ALL "
    "SELECT ? + key, vector FROM memory_keys "
    "WHERE user_id = ? AND vector IS NOT NULL AND key = ANY(?::bigint[])"
)


class PgVectors:
    """Each user's vector keys, searched where they are stored (see rows.Vectors)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def apply(self, changes: IndexChanges) -> None:
        """Nothing to do: the write's own transaction stored its vectors where searches read
        them (the HNSW indexes are the tables')."""

    async def save(self) -> int:
        """Nothing to write: the database keeps the vectors durable; 0 written."""
        return 0

    async def size_up_to(self, user_id: str, bound: int) -> int:
        """How many keys a user has (own vectors and clause vectors), or some number above
        bound when it has more than that; one statement."""
        return int(await self._db.fetchval(_SIZE_UP_TO, user_id, bound + 1, user_id, bound + 1))

    async def search(
        self, user_id: str, vector: np.ndarray, count: int, exact_up_to: int
    ) -> Matches:
        """The nearest keys of a user's: every key scored up to exact_up_to keys, HNSW above.
        The size it gives is exact up to max(count, exact_up_to), only known to be larger
        above that."""
        size = await self.size_up_to(user_id, max(count, exact_up_to))
        query = np.asarray(vector, dtype=np.float32)
        found: list[tuple[int, float]] = []
        if 0 < size <= exact_up_to:
            rows = await self._db.fetch(
                _EXACT, query, user_id, CLAUSE_KEY_OFFSET, query, user_id, count
            )
            found = [(int(r[0]), float(r[1])) for r in rows]
        elif size > exact_up_to:
            found = await self._approximate(user_id, query, count)
        keys = np.array([key for key, _ in found], dtype=np.uint64)
        scores = np.array([score for _, score in found], dtype=np.float32)
        return Matches(keys, scores, size)

    async def _approximate(
        self, user_id: str, query: np.ndarray, count: int
    ) -> list[tuple[int, float]]:
        """The best count keys of both tables' HNSW indexes, best first."""
        ef_search = min(max(count, _EF_SEARCH_MIN), _EF_SEARCH_MAX)
        async with self._db.connection() as conn, conn.transaction():
            await conn.execute(
                "SELECT set_config('hnsw.ef_search', $1, true), "
                "set_config('hnsw.iterative_scan', 'relaxed_order', true)",
                str(ef_search),
            )
            rows = await conn.fetch(
                numbered(_APPROXIMATE),
                query, user_id, query, count,
                CLAUSE_KEY_OFFSET, query, user_id, query, count,
            )
        found = sorted(((int(r[0]), float(r[1])) for r in rows), key=lambda r: -r[1])
        return found[:count]

    async def vectors(self, user_id: str, keys: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """The vectors of the given keys that the user holds, with their keys (in the order
        given); none is an empty matrix without columns."""
        own = [int(k) for k in keys if k < CLAUSE_KEY_OFFSET]
        clause = [int(k) - CLAUSE_KEY_OFFSET for k in keys if k >= CLAUSE_KEY_OFFSET]
        rows = await self._db.fetch(_VECTORS, user_id, own, CLAUSE_KEY_OFFSET, user_id, clause)
        found = {int(r[0]): r[1].to_numpy() for r in rows}
        held = [int(k) for k in keys if int(k) in found]
        if not held:
            return [], np.zeros((0, 0), dtype=np.float32)
        return held, np.stack([found[k] for k in held]).astype(np.float32)
