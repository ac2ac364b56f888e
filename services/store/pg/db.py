"""The PostgreSQL connection pool of the store, and SQL written with SQLite's `?` placeholders.

The filters the store builds (Reach.sql, repo._filters) use `?`; numbered() turns them into
asyncpg's `$1, $2, …` so the two backends share them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
from pgvector.asyncpg import register_vector

from services.store.pg.schema import WRITE_LOCK, create_or_migrate
from shared.errors import ConfigError, InvalidArgument, Unavailable
from shared.redact import redact_url

log = logging.getLogger(__name__)

_PLACEHOLDER = re.compile(r"\?")


def numbered(sql: str) -> str:
    """The statement with each `?` as `$n` (the store's SQL holds no `?` inside literals)."""
    counter = iter(range(1, 1 << 16))
    return _PLACEHOLDER.sub(lambda _: f"${next(counter)}", sql)


UNREACHABLE = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.TooManyConnectionsError,
)
"""What asyncpg raises when the database cannot be reached, is starting or stopping, or takes
no more connections: a later try may succeed."""

RETRY_MOST_S = 10.0
"""The longest wait between two tries to reach the database at start."""


@contextlib.contextmanager
def checked() -> Iterator[None]:
    """A statement's failure as the store's callers should see it: text holding a NUL (which
    PostgreSQL cannot hold, SQLite and protobuf strings can) is the caller's error; a database
    that cannot be reached is Unavailable (a retry may succeed), not the server's bug."""
    try:
        yield
    except asyncpg.CharacterNotInRepertoireError:
        raise InvalidArgument("text may not hold a NUL character") from None
    except UNREACHABLE as exc:
        raise Unavailable(f"the database does not answer: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class _OneLine(logging.Filter):
    """The pool's own warnings while the database is away (one a second, each with a traceback
    of asyncpg's insides) as one line each, naming the reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg = f"{record.getMessage()}: {_reason(record.exc_info[1])}"
            record.args = ()
            record.exc_info = None
        return True


logging.getLogger("asyncpg.pool").addFilter(_OneLine())


class Database:
    """An asyncpg pool on one database whose schema is created or checked at open."""

    def __init__(self, dsn: str, min_size: int = 2, max_size: int = 8) -> None:
        self.dsn = dsn
        self._sizes = (min_size, max_size)
        self._pool: asyncpg.Pool | None = None

    async def open(self, ndim: int) -> Database:
        """Connects, creates or checks the schema for ndim-wide vectors, then opens the pool
        (its connections know the vector types, which exist only once the schema does).

        While the database cannot be reached (it may be starting too) it tries again, waiting
        up to RETRY_MOST_S between tries; what waiting does not mend (a wrong password, no such
        database, no pgvector, a role that may not create it) is a ConfigError."""
        where = redact_url(self.dsn)
        wait = 0.5
        while True:
            try:
                await self._open(ndim, where)
                return self
            except UNREACHABLE as exc:
                log.warning("database %s does not answer (%s); trying again in %.1f s",
                            where, _reason(exc), wait)
            except asyncpg.PostgresError as exc:
                raise ConfigError(f"database {where} cannot serve the store: {exc}") from None
            await asyncio.sleep(wait)
            wait = min(wait * 2, RETRY_MOST_S)

    async def _open(self, ndim: int, where: str) -> None:
        first = await asyncpg.connect(self.dsn)
        try:
            await create_or_migrate(first, ndim, where)
        finally:
            await first.close()
        self._pool = await asyncpg.create_pool(
            self.dsn, min_size=self._sizes[0], max_size=self._sizes[1], init=register_vector
        )

    async def answers(self, timeout_s: float = 2.0) -> bool:
        """Whether the database answers a trivial query within timeout_s (readiness)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.pool.fetchval("SELECT 1")
        except (*UNREACHABLE, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            log.debug("database %s not ready: %s", redact_url(self.dsn), _reason(exc))
            return False
        return True

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
        with checked():
            return await self.pool.fetch(numbered(sql), *params)

    async def fetchval(self, sql: str, *params: Any) -> Any:
        """The first column of the first row of one read."""
        with checked():
            return await self.pool.fetchval(numbered(sql), *params)

    async def execute(self, sql: str, *params: Any) -> str:
        """One statement outside any transaction of the caller's."""
        with checked():
            return await self.pool.execute(numbered(sql), *params)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection of the pool for a block of statements, their failures checked()."""
        with checked():
            async with self.pool.acquire() as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def writing(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection inside one write transaction that holds WRITE_LOCK: committed if the
        block succeeds, rolled back otherwise (a cancelled caller included). Read committed
        whatever the server's default, so each statement sees what the replica that held
        the lock before committed."""
        async with self.connection() as conn, conn.transaction(isolation="read_committed"):
            await conn.execute("SELECT pg_advisory_xact_lock($1)", WRITE_LOCK)
            yield conn
