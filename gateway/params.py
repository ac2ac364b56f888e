"""Request parameters from the query string and a JSON object body, with type checks."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from shared.errors import InvalidArgument

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_MISSING = object()


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


async def read_body(request: web.Request) -> dict[str, Any]:
    """The JSON object body ({} when there is none); malformed JSON or a non-object is a 400."""
    if not request.body_exists:
        return {}
    raw = await request.read()  # over client_max_size: aiohttp raises 413 here
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise InvalidArgument("bad body") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"bad body: expected a JSON object, got {type(value).__name__}")
    return value


class Params:
    """Named parameters, looked up in the body and the query string in a chosen order."""

    def __init__(
        self, query: Mapping[str, str], body: Mapping[str, Any], *, query_wins: bool = False
    ) -> None:
        self._query = query
        self._body = body
        self._query_wins = query_wins

    def _lookup(self, name: str) -> tuple[Any, bool]:
        """The value and whether it came from the query string (so it is text)."""
        in_body = name in self._body and self._body[name] is not None
        in_query = name in self._query
        if in_query and (self._query_wins or not in_body):
            return self._query[name], True
        if in_body:
            return self._body[name], False
        return _MISSING, False

    def has(self, name: str) -> bool:
        """Whether the parameter was given at all (null counts as absent)."""
        return self._lookup(name)[0] is not _MISSING

    def string(self, name: str, default: str = "", *, strip: bool = True) -> str:
        """A string parameter, stripped of surrounding whitespace unless strip is False."""
        value, _ = self._lookup(name)
        if value is _MISSING:
            return default
        if not isinstance(value, str):
            raise InvalidArgument(f"{name} must be a string")
        return value.strip() if strip else value

    def integer(self, name: str, default: int, *, lo: int = 0, hi: int = 2**31 - 1) -> int:
        """A whole number within [lo, hi]."""
        value, from_query = self._lookup(name)
        if value is _MISSING:
            return default
        if from_query:
            try:
                value = int(value.strip())
            except ValueError:
                raise InvalidArgument(f"{name} must be an integer") from None
        elif isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{name} must be an integer")
        if not lo <= value <= hi:
            raise InvalidArgument(f"{name} must be between {lo} and {hi}")
        return value

    def number(self, name: str, *, lo: float, hi: float) -> float | None:
        """A number within [lo, hi], or None when absent."""
        value, from_query = self._lookup(name)
        if value is _MISSING:
            return None
        if from_query:
            try:
                value = float(value.strip())
            except ValueError:
                raise InvalidArgument(f"{name} must be a number") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidArgument(f"{name} must be a number")
        if not math.isfinite(value) or not lo <= value <= hi:
            raise InvalidArgument(f"{name} must be between {lo:g} and {hi:g}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        """A true/false parameter; the query string spells it true/false/1/0/yes/no/on/off."""
        value, _ = self._lookup(name)
        if value is _MISSING:
            return default
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            word = value.strip().lower()
            if word in _TRUE:
                return True
            if word in _FALSE:
                return False
        raise InvalidArgument(f"{name} must be true or false")

    def strings(self, name: str) -> list[str]:
        """A list of non-empty strings (a single string counts as a list of one)."""
        value, _ = self._lookup(name)
        if value is _MISSING:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise InvalidArgument(f"{name} must be a list of strings")
        return [item.strip() for item in value if item.strip()]

    def obj(self, name: str) -> dict[str, Any]:
        """A JSON object parameter (body only); {} when absent."""
        value, from_query = self._lookup(name)
        if value is _MISSING:
            return {}
        if from_query or not isinstance(value, dict):
            raise InvalidArgument(f"{name} must be a JSON object")
        return dict(value)

    def timestamp(self, name: str) -> float | None:
        """A point in time as unix seconds or an RFC3339 / ISO date string; None when absent."""
        value, _ = self._lookup(name)
        if value is _MISSING:
            return None
        if isinstance(value, str):
            return parse_time(name, value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidArgument(f"{name} must be unix seconds or an RFC3339 / ISO date string")
        if not math.isfinite(value) or not 0 <= value < 253402300800:  # before year 10000
            raise InvalidArgument(f"{name} is out of range")
        return float(value)


def parse_time(name: str, text: str) -> float:
    """Unix seconds from "1700000000", "2023-05-08", "2023-05-08T13:56:00Z" or "+02:00" offsets."""
    raw = text.strip()
    try:
        seconds = float(raw)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds) and 0 <= seconds < 253402300800:
            return seconds
        raise InvalidArgument(f"{name} is out of range")
    iso = raw[:-1] + "+00:00" if raw[-1:] in ("Z", "z") else raw
    try:
        moment = datetime.fromisoformat(iso)
    except ValueError:
        raise InvalidArgument(
            f"{name} must be unix seconds or an RFC3339 / ISO date string, got {text!r}"
        ) from None
    if moment.tzinfo is None:  # a bare date or local time is read as UTC
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()
