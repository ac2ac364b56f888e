"""When an open intention is current: one rule for search, the Now page and extraction."""

from __future__ import annotations

from shared.dates import DAY_S

OVERDUE_AFTER_S = DAY_S
"""How long after its due date an open intention is still current (HyAtlas: "a day after")."""


def is_overdue(due_at: float | None, now: float) -> bool:
    """Whether an open intention's due date is more than OVERDUE_AFTER_S gone."""
    return due_at is not None and now > due_at + OVERDUE_AFTER_S


def is_current(due_at: float | None, created_at: float, now: float, ttl_s: float | None) -> bool:
    """Whether an open intention is current: one with a due date until a day after it is due,
    one without for ttl_s after it was written (HYATLAS_INTENTION_TTL; forever when None).
    Older ones are kept, open, but no longer shown as what the user is doing now."""
    if due_at is not None:
        return not is_overdue(due_at, now)
    return ttl_s is None or now - created_at <= ttl_s
