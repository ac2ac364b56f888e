"""JSON a client sent, read strictly: no NaN or Infinity, and numbers a store can hold."""

from __future__ import annotations

import json
import math
from typing import Any

LARGEST_INTEGER = 2**63
"""Integers are within ± this (what SQLite, PostgreSQL and most JSON peers hold exactly)."""


class OutOfRange(ValueError):
    """A number beyond what a store holds (1e999 parses as infinity; 10**400 as a huge int)."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise OutOfRange(f"{text[:40]} is beyond a number's range")
    return value


def _bounded_int(text: str) -> int:
    value = int(text)
    if abs(value) > LARGEST_INTEGER:
        raise OutOfRange(f"{text[:40]} is beyond an integer's range (±2^63)")
    return value


def loads(text: str) -> Any:
    """json.loads, refusing NaN, Infinity and numbers out of range (ValueError; OutOfRange for
    the numbers). Nested deeper than the parser's stack, it raises RecursionError."""
    return json.loads(
        text,
        parse_constant=_refuse_constant,
        parse_float=_finite_float,
        parse_int=_bounded_int,
    )
