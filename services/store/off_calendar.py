"""Dates stored before they were range-checked: one no calendar shows is cleared, once."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from shared.dates import on_calendar
from shared.limits import END_OF_CALENDAR_S, START_OF_CALENDAR_S

if TYPE_CHECKING:
    from services.store.model import Edge, MemoryRow
    from services.store.rows import Rows, Writes

log = logging.getLogger(__name__)

CHECKED = "dates_on_calendar"
"""The store_meta key set once a store's rows' dates are all on the calendar."""
EDGES_CHECKED = "edge_dates_on_calendar"
"""The store_meta key set once its edges' dates are (a key of its own: a store whose rows were
checked before edges were is checked for its edges once)."""
DATES = ("event_at", "valid_to", "due_at")
EDGE_DATES = ("valid_from", "valid_to")
ACTOR = "store"
REASON = "off the calendar (stored before dates were range-checked; never a real date): cleared"


async def clear_off_calendar_dates(rows: Rows) -> None:
    """Clears the dates no calendar shows of rows (each with an audit entry) and of edges, in
    one transaction for each; each once per store (a new one is checked while empty)."""
    if await rows.get_meta(CHECKED) is None:
        await _clear_rows(rows)
        await rows.set_meta(CHECKED, "1")
    if await rows.get_meta(EDGES_CHECKED) is None:
        await _clear_edges(rows)
        await rows.set_meta(EDGES_CHECKED, "1")


async def _clear_rows(rows: Rows) -> None:
    now = time.time()
    async with rows.transaction() as w:
        found = await w.rows_off_calendar(START_OF_CALENDAR_S, END_OF_CALENDAR_S)
        for row in found:
            await _clear_row(w, row, now)
    if found:
        log.warning("cleared dates off the calendar in %d rows (see their history)", len(found))


async def _clear_edges(rows: Rows) -> None:
    async with rows.transaction() as w:
        found = await w.edges_off_calendar(START_OF_CALENDAR_S, END_OF_CALENDAR_S)
        for edge in found:
            await w.update_edge(edge.id, **dict.fromkeys(_off_calendar(edge, EDGE_DATES)))
    if found:
        log.warning("cleared dates off the calendar in %d edges: %s",
                    len(found), ", ".join(edge.id for edge in found))


def _off_calendar(held: MemoryRow | Edge, names: tuple[str, ...]) -> list[str]:
    """Which of the dates names a row or an edge holds no calendar shows."""
    return [
        name
        for name in names
        if (seconds := getattr(held, name)) is not None and not on_calendar(seconds)
    ]


async def _clear_row(w: Writes, row: MemoryRow, now: float) -> None:
    cleared = _off_calendar(row, DATES)
    await w.update(row.id, {"updated_at": now, **dict.fromkeys(cleared)})
    await w.audit(
        actor=ACTOR, action="update", row=row, before=row, after=await w.get(row.id),
        reason=f"{', '.join(cleared)} {REASON}", at=now,
    )
