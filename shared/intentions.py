"""When an open intention is current: one rule for search, the Now page and extraction."""

from __future__ import annotations

from shared.dates import DAY_S, as_local_date

OVERDUE_AFTER_S = DAY_S
"""How long after its due date an open intention is still current (HyAtlas: "a day after")."""


def due_starts(due_at: float, utc_offset_minutes: int) -> float:
    """When an intention's due date starts: a date alone (kept at its UTC midnight) is that date
    on the clock of the intention's writer (utc_offset_minutes, the row's), so "due 15 May"
    written in Los Angeles runs to the end of 15 May there; a time is that time."""
    return as_local_date(due_at, utc_offset_minutes)


def is_overdue(due_at: float | None, utc_offset_minutes: int, now: float) -> bool:
    """Whether an open intention's due date is more than OVERDUE_AFTER_S gone, on its writer's
    clock."""
    return due_at is not None and now > due_starts(due_at, utc_offset_minutes) + OVERDUE_AFTER_S


def is_current(
    due_at: float | None,
    utc_offset_minutes: int,
    created_at: float,
    now: float,
    ttl_s: float | None,
) -> bool:
    """Whether an open intention is current: one with a due date until a day after it is due
    (on its writer's clock), one without for ttl_s after it was written (HYATLAS_INTENTION_TTL;
    forever when None). Older ones are kept, open, but no longer shown as what the user is
    doing now."""
    if due_at is not None:
        return not is_overdue(due_at, utc_offset_minutes, now)
    return ttl_s is None or now - created_at <= ttl_s
