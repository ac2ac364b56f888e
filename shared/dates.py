"""Calendar dates of unix times: read from a model's reply, checked where a row keeps them,
shown in prompts and replies."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from shared.errors import InvalidArgument
from shared.limits import END_OF_CALENDAR_S, START_OF_CALENDAR_S


def parse_date(value: Any) -> float | None:
    """Unix seconds of a "YYYY-MM-DD" or an ISO date-time (read as UTC without an offset);
    None for anything else, or for a time off the calendar (checked in UTC, since an offset can
    carry 9999-12-31 into the year 10000). A fact may date from before 1970 (a birth date)."""
    if not isinstance(value, str) or not value.strip():
        return None
    raw = value.strip()
    if raw[-1:] in ("Z", "z"):
        raw = raw[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    try:
        seconds = moment.timestamp()
    except (OverflowError, ValueError):
        return None
    return seconds if on_calendar(seconds) else None


DAY_S = 86400


def as_local_date(seconds: float, utc_offset_minutes: int) -> float:
    """A date kept alone (parse_date keeps "YYYY-MM-DD", a fact's date, at its UTC midnight)
    as the midnight that starts that date on a clock at utc_offset_minutes; any other time as
    it is. So a fact of 14 May is of 14 May for an asker in Los Angeles too."""
    if seconds % DAY_S:
        return seconds
    return seconds - utc_offset_minutes * 60


def on_calendar(seconds: float) -> bool:
    """Whether a calendar date shows unix seconds: the years 1 to 9999, in UTC."""
    return START_OF_CALENDAR_S <= seconds < END_OF_CALENDAR_S


def check_on_calendar(what: str, seconds: float) -> float:
    """A time a row or an edge keeps (unix seconds), one a calendar date shows (the years 1 to
    9999: an import of an older version's export may reach back before 1970), else a 400 (NaN
    and the infinities too)."""
    if not on_calendar(seconds):
        raise InvalidArgument(f"{what} is not between the years 1 and 9999")
    return seconds


def _moment(seconds: float) -> datetime | None:
    """The UTC moment of unix seconds; None for a time no calendar date shows (a row stored
    before dates were range-checked may hold one)."""
    try:
        return datetime.fromtimestamp(int(seconds), UTC)
    except (ValueError, OverflowError, OSError):
        return None


def day(seconds: float, utc_offset_minutes: int = 0) -> str:
    """The date on a clock at utc_offset_minutes (UTC unless given), e.g. 2026-10-09; "" for a
    time no calendar date shows."""
    moment = _moment(seconds + utc_offset_minutes * 60)
    return moment.date().isoformat() if moment else ""


def writers_day(seconds: float, utc_offset_minutes: int) -> str:
    """The date a row's time (its event or due date) falls on for its writer, whose clock is
    at utc_offset_minutes; a date kept alone is that date (as_local_date)."""
    return day(as_local_date(seconds, utc_offset_minutes), utc_offset_minutes)


def rfc3339(seconds: float) -> str:
    """UTC RFC3339 at second precision, e.g. 2026-10-09T12:34:56Z; "" for a time no calendar
    date shows."""
    moment = _moment(seconds)
    return moment.isoformat().replace("+00:00", "Z") if moment else ""
