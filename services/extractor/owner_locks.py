"""One asyncio lock per owner, held only while someone holds or waits for it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable


class OwnerLocks:
    """Serialises the work of one owner at a time in this process. An owner's lock is dropped
    once nobody holds or waits for it, so a server that has seen 100,000 owners keeps none of
    their locks (a dict of every owner ever seen grew without bound)."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        """How many owners' locks are held or waited for now."""
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, owner: Hashable) -> AsyncIterator[None]:
        """Holds owner's lock for the block, waiting for any other holder first."""
        lock, users = self._locks.get(owner, (asyncio.Lock(), 0))
        self._locks[owner] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[owner]
            if users == 1:
                del self._locks[owner]
            else:
                self._locks[owner] = (lock, users - 1)
