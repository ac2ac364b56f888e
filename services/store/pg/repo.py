"""PostgreSQL reads of committed rows, and the write transactions (rows.Rows on asyncpg)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from services.store.pg.db import Database
from services.store.pg.writes import PgWrites


class PgRepo:
    """The store's rows in PostgreSQL (see rows.Rows for what each method does)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    @contextlib.asynccontextmanager
    async def transaction(
        self, committed: Callable[[], Awaitable[None]] | None = None
    ) -> AsyncIterator[PgWrites]:
        """One write transaction holding the write lock of every replica; `committed` runs
        once it is committed."""
        async with self.db.writing() as conn:
            yield PgWrites(conn)
        if committed is not None:
            await committed()

    async def get_meta(self, key: str) -> str | None:
        """A value of the store_meta table."""
        value = await self.db.fetchval("SELECT value FROM store_meta WHERE key = ?", key)
        return str(value) if value is not None else None

    async def set_meta(self, key: str, value: str) -> None:
        """Sets a value of the store_meta table."""
        await self.db.execute(
            "INSERT INTO store_meta (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            key, value,
        )
