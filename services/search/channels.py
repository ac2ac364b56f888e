"""Which channel each result goes to, the order channels are shown in, and the Now page."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.search.model import Candidate
from shared.layers import EXPERIENCE, NOW_PAGE

PAGES = "pages"
PROFILE = "profile"
PROACTIVE = "proactive"
EXPERIENCES = "experiences"
NORMAL = "normal"
NOW = "now"
CHANNELS = (PAGES, PROFILE, PROACTIVE, EXPERIENCES, NORMAL)

NOW_PAGE_LABEL = NOW_PAGE

_BY_LAYER = {
    "l8_entity": PAGES,
    "l1_profile": PROFILE,
    "l6_schema": PROFILE,
    "l7_intention": PROACTIVE,
}


def channel_of(candidate: Candidate) -> str:
    """The channel a result is shown in."""
    if candidate.layer == "l3_fact" and candidate.label == EXPERIENCE:
        return EXPERIENCES
    return _BY_LAYER.get(candidate.layer, NORMAL)


def arrange(ranked: Iterable[Candidate]) -> dict[str, list[Candidate]]:
    """Every channel, in display order, each keeping the ranked order of its results."""
    channels: dict[str, list[Candidate]] = {name: [] for name in CHANNELS}
    for candidate in ranked:
        channels[channel_of(candidate)].append(candidate)
    return channels


def add_proactive(channels: dict[str, list[Candidate]], due: Iterable[Candidate]) -> None:
    """Adds the intentions due soon that the query did not find after those it did."""
    shown = {c.memory_id for c in channels[PROACTIVE]}
    channels[PROACTIVE].extend(c for c in due if c.memory_id not in shown)


def display_order(has_now: bool) -> list[str]:
    """The channel names in the order to show them: "now" first when there is a Now page."""
    return [NOW, *CHANNELS] if has_now else list(CHANNELS)


def pick_now_page(rows: Sequence[Candidate]) -> Candidate | None:
    """The newest live L4 row labelled as the owner's Now page, if any."""
    pages = [c for c in rows if c.layer == "l4_summary" and c.label == NOW_PAGE_LABEL]
    return max(pages, key=lambda c: c.created_at, default=None)
