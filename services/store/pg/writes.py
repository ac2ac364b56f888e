"""Writes inside one PostgreSQL transaction (rows.Writes on an asyncpg connection)."""

from __future__ import annotations

import asyncpg


class PgWrites:
    """Writes inside one open transaction (see rows.Writes for what each method does)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
