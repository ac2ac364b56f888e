"""The PostgreSQL connection pool of the store, and SQL written with SQLite's `?` placeholders.

The filters the store builds (Reach.sql, repo._filters) use `?`; numbered() turns them into
asyncpg's `$1, $2, …` so the two backends share them.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
from pgvector.asyncpg import register_vector

from services.store.pg.schema import WRITE_LOCK, create_or_migrate
from shared.errors import InvalidArgument

_PLACEHOLDER = re.compile(r"\?")


def numbered(sql: str) -> str:
    """The statement with each `?` as `$n` (the store's SQL holds no `?` inside literals)."""
    counter = iter(range(1, 1 << 16))
    return _PLACEHOLDER.sub(lambda _: f"${next(counter)}", sql)


def redacted_dsn(dsn: str) -> str:
    """The DSN without its password, for logs and errors."""
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", dsn)


@contextlib.contextmanager
def text_checked() -> Iterator[None]:
    """PostgreSQL cannot hold a NUL character in text, which SQLite and protobuf strings can:
    a statement refused for one is the caller's error, not the server's."""
    try:
        yield
    except asyncpg.CharacterNotInRepertoireError:
        raise InvalidArgument("text may not hold a NUL character") from None


class Database:
    """An asyncpg pool on one database whose schema is created or checked at open."""

    def __init__(self, dsn: str, min_size: int = 2, max_size: int = 8) -> None:
        self.dsn = dsn
        self._sizes = (min_size, max_size)
        self._pool: asyncpg.Pool | None = None

    async def open(self, ndim: int) -> Database:
        """Connects, creates or checks the schema for ndim-wide vectors, then opens the pool
        (its connections know the vector types, which exist only once the schema does)."""
        first = await asyncpg.connect(self.dsn)
        try:
            await create_or_migrate(first, ndim, redacted_dsn(self.dsn))
        finally:
            await first.close()
        self._pool = await asyncpg.create_pool(
            self.dsn, min_size=self._sizes[0], max_size=self._sizes[1], init=register_vector
        )
        return self

    async def close(self) -> None:
        """Closes the pool; closing twice is harmless."""
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @property
    def pool(self) -> asyncpg.Pool:
        """The pool (open)."""
        if self._pool is None:
            raise RuntimeError("database is closed")
        return self._pool

    async def fetch(self, sql: str, *params: Any) -> list[asyncpg.Record]:
        """The rows of one read (with `?` placeholders)."""
        with text_checked():
            return await self.pool.fetch(numbered(sql), *params)

    async def fetchval(self, sql: str, *params: Any) -> Any:
        """The first column of the first row of one read."""
        with text_checked():
            return await self.pool.fetchval(numbered(sql), *params)

    async def execute(self, sql: str, *params: Any) -> str:
        """One statement outside any transaction of the caller's."""
        with text_checked():
            return await self.pool.execute(numbered(sql), *params)

    @contextlib.asynccontextmanager
    async def writing(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection inside one write transaction that holds WRITE_LOCK: committed if the
        block succeeds, rolled back otherwise (a cancelled caller included). Read committed
        whatever the server's default, so each statement sees what the replica that held
        the lock before committed."""
        async with self.pool.acquire() as conn, conn.transaction(isolation="read_committed"):
            await conn.execute("SELECT pg_advisory_xact_lock($1)", WRITE_LOCK)
            with text_checked():
                yield conn
