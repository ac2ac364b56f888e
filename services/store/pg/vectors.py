"""Nearest-neighbour search in pgvector (rows.Vectors): HNSW, or exact for a small owner."""

from __future__ import annotations

from services.store.pg.db import Database


class PgVectors:
    """Each user's vector keys, searched where they are stored (see rows.Vectors)."""

    def __init__(self, db: Database) -> None:
        self._db = db
