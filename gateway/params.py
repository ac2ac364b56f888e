"""Request parameters from the query string and a JSON object body, with type checks."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web
from multidict import MultiMapping

from shared import client_json
from shared.errors import InvalidArgument
from shared.limits import (
    END_OF_CALENDAR_S,
    FIRST_TIME_S,
    MAX_JSON_DEPTH,
    check_id_list,
    check_name,
    check_text,
)

# Parameters that carry free text (check_text: up to MAX_TEXT_CHARS, no NUL); every other string
# is a name or an id (check_name: up to MAX_NAME_CHARS).
FREE_TEXT = frozenset({"text", "data", "query", "old_text", "reason", "key", "llm_key", "node"})
TIME_RANGE = "must lie between 1970-01-01T00:00:00Z and 9999-12-31T23:59:59Z"

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_MISSING = object()


async def read_body(request: web.Request) -> dict[str, Any]:
    """The JSON object body ({} when there is none); malformed JSON or a non-object is a 400."""
    if not request.body_exists:
        return {}
    raw = await request.read()  # over client_max_size: aiohttp raises 413 here
    if not raw.strip():
        return {}
    try:
        # Decoded here, strictly: json.loads would take UTF-16 too, and lone surrogates with it.
        text = raw.decode("utf-8-sig")
        value = client_json.loads(text)
    except client_json.OutOfRange as exc:
        raise InvalidArgument(f"bad body: {exc}") from None
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise InvalidArgument("bad body") from None
    except RecursionError:  # nested deeper than the parser's stack
        raise InvalidArgument(f"bad body: nested over {MAX_JSON_DEPTH} levels deep") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"bad body: expected a JSON object, got {type(value).__name__}")
    try:
        client_json.check_decoded(text, value, "body")
    except InvalidArgument as exc:
        raise InvalidArgument(f"bad body: {exc.message}") from None
    return value


def check_string(name: str, value: str) -> str:
    """A string parameter within its limits: free text (FREE_TEXT) as check_text takes it, any
    other as check_name does."""
    if name in FREE_TEXT:
        check_text(name, value)
    else:
        check_name(name, value)
    return value


class Params:
    """Named parameters, looked up in the body and the query string in a chosen order."""

    def __init__(
        self, query: MultiMapping[str], body: Mapping[str, Any], *, query_wins: bool = False
    ) -> None:
        self._query = query
        self._body = body
        self._query_wins = query_wins

    def _lookup(self, name: str, *, many: bool = False) -> tuple[Any, bool]:
        """The value and whether it came from the query string (so it is text). A name the
        query string repeats gives all its values when many are wanted, else a 400."""
        in_body = name in self._body and self._body[name] is not None
        in_query = name in self._query
        if in_query and (self._query_wins or not in_body):
            values = self._query.getall(name)
            if len(values) == 1:
                return values[0], True
            if not many:
                raise InvalidArgument(f"{name} is given {len(values)} times; it takes one value")
            return list(values), True
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
        check_string(name, value)
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
        """A list of non-empty strings (a single string counts as a list of one; in the query
        string, the name repeated); blank ones are left out."""
        return [item for item in self._string_list(name) or [] if item]

    def ids(self, name: str, most: int) -> list[str] | None:
        """A list of ids as strings reads it, None when absent; given, it must hold at least
        one, and at most `most`, none blank (check_id_list)."""
        items = self._string_list(name)
        if items is None:
            return None
        if not items:
            raise InvalidArgument(f"{name} must hold at least one id")
        check_id_list(name, items, most)
        return items

    def _string_list(self, name: str) -> list[str] | None:
        """The stripped strings of a list parameter, blank ones too; None when absent."""
        value, _ = self._lookup(name, many=True)
        if value is _MISSING:
            return None
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise InvalidArgument(f"{name} must be a list of strings")
        return [check_string(name, item).strip() for item in value]

    def obj(self, name: str) -> dict[str, Any]:
        """A JSON object parameter (body only) within check_object's limits; {} when absent."""
        value, from_query = self._lookup(name)
        if value is _MISSING:
            return {}
        if from_query or not isinstance(value, dict):
            raise InvalidArgument(f"{name} must be a JSON object")
        client_json.check_object(name, value)
        return dict(value)

    def timestamp(self, name: str) -> float | None:
        """A point in time as unix seconds or an RFC3339 / ISO date string; None when absent."""
        found = self.time_and_offset(name)
        return None if found is None else found[0]

    def time_and_offset(self, name: str) -> tuple[float, int | None] | None:
        """A point in time as timestamp reads it, with the UTC offset it was written at in
        minutes (zero for a "Z" time; None for unix seconds or a time without an offset, read
        as UTC); None when absent."""
        value, _ = self._lookup(name)
        if value is _MISSING:
            return None
        if isinstance(value, str):
            seconds, offset = parse_time(name, value)
            return seconds, None if offset is None else _offset_minutes(name, offset)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidArgument(f"{name} must be unix seconds or an RFC3339 / ISO date string")
        return _in_range(name, float(value)), None


def _offset_minutes(name: str, offset: timedelta) -> int:
    """A time's UTC offset in minutes: the days of the clock it was written by start at midnight
    by that clock ("yesterday" at 20:00-08:00 is the day before there, not in UTC)."""
    minutes, rest = divmod(offset, timedelta(minutes=1))
    if rest:  # ISO 8601 and Python take seconds in an offset; RFC3339 and real clocks do not
        raise InvalidArgument(f"the UTC offset of {name} must be whole minutes (+hh:mm)")
    return int(minutes)


def parse_time(name: str, text: str) -> tuple[float, timedelta | None]:
    """Unix seconds and the UTC offset from "1700000000", "2023-05-08", "2023-05-08T13:56:00Z"
    or "+02:00" offsets; the offset is None when the text names none (read as UTC)."""
    raw = text.strip()
    try:
        seconds = float(raw)
    except ValueError:
        pass
    else:
        if not raw.lstrip("+-").isalpha():  # float also reads "nan" and "inf": no time at all
            return _in_range(name, seconds), None
    iso = raw[:-1] + "+00:00" if raw[-1:] in ("Z", "z") else raw
    try:
        moment = datetime.fromisoformat(iso)
    except ValueError:
        raise InvalidArgument(
            f"{name} must be unix seconds or an RFC3339 / ISO date string, got {text!r}"
        ) from None
    if moment.tzinfo is None:  # a bare date or local time is read as UTC
        return _in_range(name, moment.replace(tzinfo=UTC).timestamp()), None
    # An offset can move a date at either end of the calendar out of it (year 0 or 10000).
    return _in_range(name, moment.timestamp()), moment.utcoffset() or timedelta()


def _in_range(name: str, seconds: float) -> float:
    """The one range check of every point in time a client sends, numbers and dates alike."""
    if not math.isfinite(seconds) or not FIRST_TIME_S <= seconds < END_OF_CALENDAR_S:
        raise InvalidArgument(f"{name} is out of range: it {TIME_RANGE}")
    return seconds
