"""Dates in a query ("yesterday", "last week", "in May 2023", "2 days ago") as time ranges; whether
a query asks when, and whether a text says when."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone

MONTHS = {
    name: number
    for number, names in enumerate(
        (
            ("january", "jan"),
            ("february", "feb"),
            ("march", "mar"),
            ("april", "apr"),
            ("may",),
            ("june", "jun"),
            ("july", "jul"),
            ("august", "aug"),
            ("september", "sep", "sept"),
            ("october", "oct"),
            ("november", "nov"),
            ("december", "dec"),
        ),
        start=1,
    )
    for name in names
}
WEEKDAYS = {
    name: number
    for number, names in enumerate(
        (
            ("monday", "mon"),
            ("tuesday", "tue", "tues"),
            ("wednesday", "wed"),
            ("thursday", "thu", "thur", "thurs"),
            ("friday", "fri"),
            ("saturday", "sat"),
            ("sunday", "sun"),
        )
    )
    for name in names
}
NUMBER_WORDS = {
    "a": 1,
    "an": 1,
    "one": 1,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "couple": 2,
    "few": 3,
    "several": 3,
}
UNIT_DAYS = {"day": 1, "week": 7, "fortnight": 14, "month": 30, "year": 365}

_MONTH = "|".join(sorted(MONTHS, key=len, reverse=True))
_WEEKDAY = "|".join(sorted((w for w in WEEKDAYS if len(w) > 3), key=len, reverse=True))
_NUMBER = r"\d+|" + "|".join(sorted(NUMBER_WORDS, key=len, reverse=True))
_UNIT = r"day|week|fortnight|month|year"

_ISO = re.compile(r"\b(\d{4})-(\d{1,2})-(\d{1,2})\b")
_DAY_MONTH_YEAR = re.compile(
    rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?({_MONTH})\.?,?\s+(\d{{4}})\b"
)
_MONTH_DAY_YEAR = re.compile(rf"\b({_MONTH})\.?\s+(\d{{1,2}})(?:st|nd|rd|th)?,?\s+(\d{{4}})\b")
_MONTH_YEAR = re.compile(rf"\b({_MONTH})\.?,?\s+(\d{{4}})\b")
_IN_MONTH = re.compile(rf"\b(in|during|since|last|this|of)\s+({_MONTH})\b")
# "May" is also the verb. After "this" or "since", words that can begin a clause ("this may
# help", "since may I ask"), it is read as the month only where no word follows it ("this May.",
# "since May, we"); after "in", "during", "last" and "of", which take a noun, always. In doubt
# it names no date: a missed date only forgoes a boost, a false one lifts the wrong memories.
_MAY_IS_A_VERB_AFTER = frozenset({"this", "since"})
_NEXT_WORD = re.compile(r"\s+[^\W\d_]")
_YEAR = re.compile(r"\b(?:in|during|of|since)\s+((?:19|20)\d{2})\b")
_AGO = re.compile(rf"\b({_NUMBER})\s+(?:of\s+)?({_UNIT})s?\s+ago\b")
_RELATIVE = re.compile(r"\b(last|this|next|past|previous)\s+(week|weekend|month|year)\b")
_WEEKDAY_RE = re.compile(rf"\b(?:(last|this|next|on|past)\s+)?({_WEEKDAY})s?\b")
_DAY_WORDS = re.compile(r"\b(today|tonight|yesterday|tomorrow|the day before yesterday)\b")
_RECENTLY = re.compile(r"\b(recently|lately|these days)\b")
_LENGTH = re.compile(rf"\b({_NUMBER})\s+(?:of\s+)?({_UNIT})s?\b")
_WORD = re.compile(r"[a-z]+|\d+")
FOUR_DIGITS = "0000"
"""Stands among a text's words (text_words) for any number of four digits it holds."""
_MONTH_WORDS = frozenset(MONTHS)
_UNIT_WORDS = frozenset(f"{unit}{s}" for unit in UNIT_DAYS for s in ("", "s"))
# A query that asks for a time: when something happened, or how long it has been.
_ASKS_WHEN = re.compile(
    r"^\s*when\b|\bwhen\s+(?:did|does|do|is|was|are|were|will|has|have)\b|\bhow\s+long\b"
    r"|\bhow\s+many\s+(?:years|months|weeks|days)\b|\bwhat\s+(?:year|month|day|date|time)\b"
    r"|\bsince\s+when\b"
)


@dataclass(frozen=True, slots=True)
class TimeRange:
    """A half-open span [start, end) of unix seconds that a query's date names."""

    start: float
    end: float
    text: str
    """The words it was read from."""

    def contains(self, when: float) -> bool:
        """Whether a moment falls inside the span."""
        return self.start <= when < self.end


@dataclass(frozen=True, slots=True)
class _Calendar:
    """The asker's days: the reference day, and each day from midnight at their UTC offset."""

    today: date
    zone: timezone

    @classmethod
    def at(cls, reference_time: float, utc_offset_minutes: int) -> _Calendar:
        """The calendar of someone at the given UTC offset at reference_time."""
        zone = timezone(timedelta(minutes=utc_offset_minutes))
        return cls(datetime.fromtimestamp(reference_time, zone).date(), zone)

    def _start(self, day: date) -> float:
        return datetime(day.year, day.month, day.day, tzinfo=self.zone).timestamp()

    def days(self, first: date, count: int, text: str) -> TimeRange:
        """The span of count days from the midnight that starts first."""
        return TimeRange(self._start(first), self._start(first + timedelta(days=count)), text)

    def day(self, year: int, month: int, day: int, text: str) -> TimeRange:
        """The span of one day."""
        return self.days(date(year, month, day), 1, text)

    def month(self, year: int, month: int, text: str) -> TimeRange:
        """The span of one month."""
        following = date(year + 1, 1, 1) if month == 12 else date(year, month + 1, 1)
        return TimeRange(self._start(date(year, month, 1)), self._start(following), text)

    def year(self, year: int, text: str) -> TimeRange:
        """The span of one year."""
        return TimeRange(self._start(date(year, 1, 1)), self._start(date(year + 1, 1, 1)), text)


def _count(word: str) -> int:
    return int(word) if word.isdigit() else NUMBER_WORDS[word]


Reader = Callable[[re.Match[str], _Calendar], TimeRange | None]
"""Reads one kind of date from its match, on the asker's calendar (None: no date after all)."""


@dataclass(frozen=True)
class DateKind:
    """One kind of date, or of length of time: its pattern (over lowercase text), the words a
    text that names one holds at least one of (see text_words), and its reader."""

    pattern: re.Pattern[str]
    needs: frozenset[str]
    read: Reader


LENGTH = DateKind(_LENGTH, _UNIT_WORDS, lambda m, cal: None)
"""A length of time ("3 years", "a few weeks"): how a how-long question is answered (it names
no date: the reader finds none)."""


def parse_dates(query: str, reference_time: float, utc_offset_minutes: int = 0) -> list[TimeRange]:
    """Every date the query names, read against reference_time (unix seconds) in the days of
    someone at utc_offset_minutes ("yesterday" runs from their midnight to midnight; 0: UTC).

    Deterministic: the same words and reference time give the same ranges. Vague words get
    generous spans ("2 days ago" is that day give or take one, "recently" the last 30 days).
    The reference time at the offset must fall within the calendar (SearchQuery checks it).
    """
    lowered = query.lower()
    kinds = kinds_in(text_words(lowered))
    if not kinds:
        return []
    return list(_read_dates(lowered, kinds, _Calendar.at(reference_time, utc_offset_minutes)))


def _read_dates(
    lowered: str, kinds: Sequence[DateKind], calendar: _Calendar
) -> Iterator[TimeRange]:
    """The dates of those kinds in a lowercase text, in reading order: earlier kinds go first,
    and words one has read ("May 8, 2023") are not read again ("May")."""
    taken: list[tuple[int, int]] = []
    for kind in kinds:
        for m in kind.pattern.finditer(lowered):
            found_range = _within_calendar(kind.read, m, calendar)
            if found_range is not None and not _overlaps(m.span(), taken):
                taken.append(m.span())
                yield found_range


def text_words(lowered: str) -> AbstractSet[str]:
    """The words and numbers of a lowercase text, and FOUR_DIGITS if a number has four digits:
    a date or a length of time is looked for only in a text holding a word it needs."""
    words = set(_WORD.findall(lowered))
    if any(len(word) == 4 and word.isdigit() for word in words):
        words.add(FOUR_DIGITS)
    return words


def kinds_in(words: AbstractSet[str]) -> list[DateKind]:
    """The kinds of date a text with these words may name, in reading order (most texts hold
    the words of none)."""
    return [kind for kind in DATE_KINDS if not kind.needs.isdisjoint(words)]


def asks_when(query: str) -> bool:
    """Whether a query asks for a time: when something happened, or for how long."""
    return _ASKS_WHEN.search(query.lower()) is not None


def says_when(text: str, reference_time: float) -> bool:
    """Whether a text names a time: a date parse_dates reads in it (against reference_time),
    or a length of time ("for 3 years")."""
    lowered = text.lower()
    words = text_words(lowered)
    if not LENGTH.needs.isdisjoint(words) and LENGTH.pattern.search(lowered) is not None:
        return True
    kinds = kinds_in(words)
    if not kinds:
        return False
    dates = _read_dates(lowered, kinds, _Calendar.at(reference_time, 0))
    return next(dates, None) is not None


def _overlaps(span: tuple[int, int], taken: list[tuple[int, int]]) -> bool:
    return any(span[0] < end and start < span[1] for start, end in taken)


def _within_calendar(read: Reader, m: re.Match[str], calendar: _Calendar) -> TimeRange | None:
    """The range one reader finds in a match, or None for none or a date off the calendar."""
    try:
        return read(m, calendar)
    except (ValueError, OverflowError):
        # A date no calendar has ("2023-02-30") or past either end of it ("99999999 days ago",
        # "next year" in 9999) names no day a memory can have; the query's other dates count.
        return None


def _in_month(m: re.Match[str], calendar: _Calendar) -> TimeRange | None:
    if m[2] == "may" and m[1] in _MAY_IS_A_VERB_AFTER and _NEXT_WORD.match(m.string, m.end()):
        return None
    month = MONTHS[m[2]]
    today = calendar.today
    # "in May" without a year is the latest May that has begun by the reference day.
    year = today.year if month <= today.month else today.year - 1
    return calendar.month(year, month, m[0])


def _ago(m: re.Match[str], calendar: _Calendar) -> TimeRange:
    days = _count(m[1]) * UNIT_DAYS[m[2]]
    slack = max(1, days // 7)
    return calendar.days(calendar.today - timedelta(days=days + slack), 2 * slack + 1, m[0])


def _day_word(m: re.Match[str], calendar: _Calendar) -> TimeRange:
    offset = {"today": 0, "tonight": 0, "yesterday": -1, "tomorrow": 1}.get(m[1], -2)
    return calendar.days(calendar.today + timedelta(days=offset), 1, m[0])


def _relative(which: str, unit: str, calendar: _Calendar, text: str) -> TimeRange:
    step = {"last": -1, "past": -1, "previous": -1, "this": 0, "next": 1}[which]
    today = calendar.today
    if unit == "week":
        monday = today - timedelta(days=today.weekday())
        if which == "past":
            return calendar.days(today - timedelta(days=7), 8, text)
        return calendar.days(monday + timedelta(weeks=step), 7, text)
    if unit == "weekend":
        saturday = today - timedelta(days=(today.weekday() - 5) % 7)
        if step > 0 or (step == 0 and today.weekday() < 5):
            saturday += timedelta(weeks=1)
        if step < 0 and today.weekday() >= 5:
            saturday -= timedelta(weeks=1)
        return calendar.days(saturday, 2, text)
    if unit == "month":
        if which == "past":
            return calendar.days(today - timedelta(days=30), 31, text)
        month_index = today.year * 12 + today.month - 1 + step
        return calendar.month(month_index // 12, month_index % 12 + 1, text)
    if which == "past":
        return calendar.days(today - timedelta(days=365), 366, text)
    return calendar.year(today.year + step, text)


def _weekday(which: str, weekday: int, calendar: _Calendar, text: str) -> TimeRange:
    today = calendar.today
    back = (today.weekday() - weekday) % 7
    if which == "next":
        ahead = (weekday - today.weekday()) % 7 or 7
        return calendar.days(today + timedelta(days=ahead), 1, text)
    if which == "last" and back == 0:
        back = 7
    # A bare or "last" weekday is the latest one on or before the reference day.
    return calendar.days(today - timedelta(days=back), 1, text)


_NUMBERED = frozenset({FOUR_DIGITS})
DATE_KINDS = (
    DateKind(_ISO, _NUMBERED, lambda m, cal: cal.day(int(m[1]), int(m[2]), int(m[3]), m[0])),
    DateKind(
        _DAY_MONTH_YEAR,
        _MONTH_WORDS,
        lambda m, cal: cal.day(int(m[3]), MONTHS[m[2]], int(m[1]), m[0]),
    ),
    DateKind(
        _MONTH_DAY_YEAR,
        _MONTH_WORDS,
        lambda m, cal: cal.day(int(m[3]), MONTHS[m[1]], int(m[2]), m[0]),
    ),
    DateKind(_MONTH_YEAR, _MONTH_WORDS, lambda m, cal: cal.month(int(m[2]), MONTHS[m[1]], m[0])),
    DateKind(_IN_MONTH, _MONTH_WORDS, _in_month),
    DateKind(_YEAR, _NUMBERED, lambda m, cal: cal.year(int(m[1]), m[0])),
    DateKind(_AGO, frozenset({"ago"}), _ago),
    DateKind(
        _RELATIVE,
        frozenset({"week", "weekend", "month", "year"}),
        lambda m, cal: _relative(m[1], m[2], cal, m[0]),
    ),
    DateKind(_DAY_WORDS, frozenset({"today", "tonight", "yesterday", "tomorrow"}), _day_word),
    DateKind(
        _WEEKDAY_RE,
        frozenset(f"{day}{s}" for day in _WEEKDAY.split("|") for s in ("", "s")),
        lambda m, cal: _weekday(m[1] or "", WEEKDAYS[m[2]], cal, m[0]),
    ),
    DateKind(
        _RECENTLY,
        frozenset({"recently", "lately", "days"}),
        lambda m, cal: cal.days(cal.today - timedelta(days=30), 31, m[0]),
    ),
)
"""Each kind of date a text may name, in reading order."""
