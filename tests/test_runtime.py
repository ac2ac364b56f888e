"""Background tasks are owned by an exit stack: stopped with it, and never fail in silence."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from shared.runtime import background


async def test_a_background_task_is_cancelled_and_awaited_when_its_stack_unwinds() -> None:
    async with contextlib.AsyncExitStack() as stack:
        task = background(stack, asyncio.Event().wait(), "idle")
        assert task.get_name() == "idle" and not task.done()
    assert task.cancelled()


async def test_a_background_task_that_died_raises_its_error_when_its_stack_unwinds() -> None:
    async def broken() -> None:
        raise RuntimeError("the loop broke")

    with pytest.raises(RuntimeError, match="the loop broke"):
        async with contextlib.AsyncExitStack() as stack:
            task = background(stack, broken(), "broken")
            await asyncio.wait([task])
