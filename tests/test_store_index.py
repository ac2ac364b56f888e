"""The vector indexes' lock: writes are not starved, and a save does not hold up searches."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from services.store.index import ReadWriteLock


async def settle() -> None:
    """Lets every task that can run, run (the loop goes round until nothing is ready)."""
    for _ in range(50):
        await asyncio.sleep(0)


def holder(
    order: list[str], name: str, enter: Callable[[], contextlib.AbstractAsyncContextManager[None]]
) -> tuple[asyncio.Event, Callable[[], asyncio.Task[None]]]:
    release = asyncio.Event()

    async def hold() -> None:
        async with enter():
            order.append(name)
            await release.wait()

    return release, lambda: asyncio.create_task(hold())


async def test_a_waiting_write_goes_before_later_searches() -> None:
    lock, order = ReadWriteLock(), []
    first, start_first = holder(order, "search 1", lock.reading)
    write, start_write = holder(order, "write", lock.writing)
    second, start_second = holder(order, "search 2", lock.reading)
    tasks = [start_first()]
    await settle()
    tasks += [start_write()]
    await settle()
    tasks += [start_second()]
    await settle()
    assert order == ["search 1"]
    first.set()
    await settle()
    assert order == ["search 1", "write"]
    write.set()
    second.set()
    await asyncio.gather(*tasks)
    assert order == ["search 1", "write", "search 2"]


async def test_searches_go_on_beside_a_save_that_a_write_waits_for() -> None:
    lock, order = ReadWriteLock(), []

    @contextlib.asynccontextmanager
    async def saving() -> AsyncIterator[None]:
        async with lock.reading(saving=True):
            yield

    save, start_save = holder(order, "save", saving)
    write, start_write = holder(order, "write", lock.writing)
    search, start_search = holder(order, "search", lock.reading)
    tasks = [start_save()]
    await settle()
    tasks += [start_write()]
    await settle()
    tasks += [start_search()]
    await settle()
    assert order == ["save", "search"]
    search.set()
    save.set()
    write.set()
    await asyncio.gather(*tasks)
    assert order == ["save", "search", "write"]
