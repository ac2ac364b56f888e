"""JSON a client sent, read strictly: no NaN or Infinity, and numbers a store can hold."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from shared.errors import InvalidArgument, TooLarge
from shared.limits import MAX_JSON_DEPTH, MAX_METADATA_BYTES, MAX_NAME_CHARS

LARGEST_INTEGER = 2**63
"""Integers are within ± this (what SQLite, PostgreSQL and most JSON peers hold exactly)."""

# A \\uXXXX escape of a UTF-16 surrogate: the only way UTF-8 JSON text decodes to one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


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


def check_decoded(text: str, value: Any, where: str) -> None:
    """Refuses what loads(text) gave when it nests over MAX_JSON_DEPTH levels or holds a string
    that is not valid Unicode; where names value in the error. Each check walks value, so each
    runs only when text leaves it in doubt."""
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        check_depth(value, where)
    check_strings(text, value, where)


def check_strings(text: str, value: Any, where: str) -> None:
    """Refuses what loads(text) gave when a string (or key) in it is not valid Unicode; the
    walk runs only when text holds an escape of a surrogate."""
    if _SURROGATE_ESCAPE.search(text):
        check_unicode(value, where)


def check_object(what: str, value: dict[str, Any]) -> str:
    """A metadata object as compact JSON, when it nests at most MAX_JSON_DEPTH levels and
    holds no NUL character in a string or key (else a 400: PostgreSQL's JSON cannot hold one,
    so SQLite is not let keep one either) and takes at most MAX_METADATA_BYTES of UTF-8 (else a
    413)."""
    check_depth(value, what)
    if _holds_nul(value):
        raise InvalidArgument(f"{what} may not hold a NUL character")
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    size = len(text.encode())
    if size > MAX_METADATA_BYTES:
        raise TooLarge(f"{what} is {size:,} bytes as JSON; the limit is {MAX_METADATA_BYTES:,}")
    return text


def check_depth(value: Any, where: str, levels: int = MAX_JSON_DEPTH) -> None:
    """Refuses a JSON value whose arrays and objects nest over levels deep."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:  # a loop, not recursion: the depth is what is being checked
        item, depth = pending.pop()
        if depth > levels:
            raise InvalidArgument(f"{where} is nested over {levels} levels deep")
        children = item.values() if isinstance(item, dict) else item
        pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _holds_nul(value: Any) -> bool:
    """Whether a string or key anywhere in a JSON value holds a NUL (its depth is checked)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


def check_unicode(value: Any, where: str) -> None:
    """Refuses a JSON value holding a string (or key) that is not valid Unicode, such as a lone
    surrogate "\\ud800", which no store can encode."""
    try:  # one pass in C; the walk below runs only to name the culprit
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        culprit = _surrogate_at(value, where)[:MAX_NAME_CHARS]
        raise InvalidArgument(f"{culprit} is not valid Unicode (a lone surrogate)") from None


def _surrogate_at(value: Any, where: str) -> str:
    """Where in value a string UTF-8 cannot encode lies ("" if none; the depth is bounded)."""
    if isinstance(value, str):
        return "" if _encodes(value) else where
    if isinstance(value, list):
        children = [(f"{where}[{index}]", child) for index, child in enumerate(value)]
    elif isinstance(value, dict):
        if not all(_encodes(key) for key in value):
            return f"a key of {where}"
        children = [(f"{where}.{key}", child) for key, child in value.items()]
    else:
        return ""
    for path, child in children:
        found = _surrogate_at(child, path)
        if found:
            return found
    return ""


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
