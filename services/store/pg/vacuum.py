"""The VACUUM that takes erased text out of PostgreSQL's tables: one pass at a time, shared."""

from __future__ import annotations

import asyncio

from services.store.pg.db import Database

# The tables that hold a row's text: its own, its keys', its history's.
VACUUM = "VACUUM memories, memory_keys, audit"


class Vacuums:
    """VACUUM passes on this replica, one at a time, each shared by every caller that asked
    before it began.

    PostgreSQL keeps a deleted tuple in its page until a vacuum prunes it, and a pass reads
    the tables' changed pages and every index: it runs outside the write lock, and the deletes
    that come while one runs share the next pass rather than queue one each (each would hold a
    pooled connection, waiting for the table locks the running pass holds).
    """

    def __init__(self, db: Database) -> None:
        self._db = db
        self._running: asyncio.Task[None] | None = None
        self._next: asyncio.Task[None] | None = None

    async def pass_after_now(self) -> None:
        """Returns once a pass that began after this call has ended, so the tuples of every
        delete committed before the call are pruned (unless a transaction older than the
        delete still runs). A caller that gives up (its deadline) leaves the pass to run."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_task(self._pass(self._running))
        await asyncio.shield(self._next)

    async def _pass(self, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            await asyncio.wait([before])  # its failure is its own callers'
        self._running, self._next = self._next, None
        await self._db.execute(VACUUM)

    async def close(self) -> None:
        """Waits for the passes asked for rather than cutting them short: each is some deleted
        text's way out of the files."""
        pending = [task for task in (self._running, self._next) if task is not None]
        if pending:
            await asyncio.wait(pending)
