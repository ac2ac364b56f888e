"""Dates stored before they were range-checked: one no calendar shows is cleared, once."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from shared.dates import on_calendar
from shared.limits import END_OF_CALENDAR_S, START_OF_CALENDAR_S

if TYPE_CHECKING:
    from services.store.model import MemoryRow
    from services.store.rows import Rows, Writes

log = logging.getLogger(__name__)

CHECKED = "dates_on_calendar"
"""The store_meta key set once a store's dates are all on the calendar."""
DATES = ("event_at", "valid_to", "due_at")
ACTOR = "store"
REASON = "off the calendar (stored before dates were range-checked; never a real date): cleared"


async def clear_off_calendar_dates(rows: Rows) -> None:
    """Clears each row's dates that no calendar shows, each row with an audit entry, in one
    transaction; once per store (a new one is checked while empty)."""
    if await rows.get_meta(CHECKED) is not None:
        return
    now = time.time()
    async with rows.transaction() as w:
        found = await w.rows_off_calendar(START_OF_CALENDAR_S, END_OF_CALENDAR_S)
        for row in found:
            await _clear(w, row, now)
    await rows.set_meta(CHECKED, "1")
    if found:
        log.warning("cleared dates off the calendar in %d rows (see their history)", len(found))


async def _clear(w: Writes, row: MemoryRow, now: float) -> None:
    cleared = [
        name
        for name in DATES
        if (seconds := getattr(row, name)) is not None and not on_calendar(seconds)
    ]
    await w.update(row.id, {"updated_at": now, **dict.fromkeys(cleared)})
    await w.audit(
        actor=ACTOR, action="update", row=row, before=row, after=await w.get(row.id),
        reason=f"{', '.join(cleared)} {REASON}", at=now,
    )
