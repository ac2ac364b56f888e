"""The polling helpers pass on what a check asserts, never on a value it happens to return."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import assert_eventually, value_eventually


async def test_a_check_passes_only_by_returning_true_or_none() -> None:
    await assert_eventually(lambda: True, timeout_s=0.05)
    await assert_eventually(lambda: None, timeout_s=0.05)
    values: list[Any] = [False, 0, [], {"ok": True}]
    for value in values:
        with pytest.raises(AssertionError, match="check returned"):
            await assert_eventually(lambda v=value: v, timeout_s=0.05, interval_s=0.01)


async def test_a_value_is_handed_back_once_its_asserts_hold() -> None:
    calls: list[int] = []

    def third_call() -> list[int]:
        calls.append(len(calls))
        assert len(calls) == 3
        return calls

    assert await value_eventually(third_call, interval_s=0.01) == [0, 1, 2]
