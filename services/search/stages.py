"""The ranking stages: each takes the ranked list and the context and returns a new list."""

from __future__ import annotations

from services.search.channels import NOW_PAGE_LABEL
from services.search.fusion import fuse_sources
from services.search.model import Candidate, SearchContext
from shared.intentions import DAY_S, due_starts, is_current
from shared.text import content_key


def fuse(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Starts the ranking: reciprocal-rank fusion of the vector and keyword hits."""
    return fuse_sources(ctx.vector, ctx.keyword, min_score=ctx.floor)


def intention_is_live(candidate: Candidate, now: float, ttl_s: float | None) -> bool:
    """Whether an L7 intention may still be shown: while it is current (shared.intentions);
    every other layer always may."""
    if candidate.layer != "l7_intention":
        return True
    return is_current(
        candidate.due_at, candidate.utc_offset_minutes, candidate.created_at, now, ttl_s
    )


DUE_SOON_S = 2 * DAY_S
"""How near its due date an open intention is shown whatever the query."""


def due_soon(intentions: list[Candidate], now: float) -> list[Candidate]:
    """The live intentions due within DUE_SOON_S (or overdue by under a day), soonest first,
    each due date on its writer's clock (shared.intentions)."""
    dated = [(due_starts(c.due_at, c.utc_offset_minutes), c) for c in intentions
             if c.due_at is not None]
    return [
        c for starts, c in sorted(dated, key=lambda pair: pair[0])
        if starts <= now + DUE_SOON_S and intention_is_live(c, now, None)
    ]


def drop_stale_intentions(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Drops intentions past their due date or their time to live."""
    return [c for c in ranked if intention_is_live(c, ctx.now, ctx.intention_ttl_s)]


def drop_ended(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Drops rows no longer true: their valid_to has passed (a relation whose edge ended)."""
    return [c for c in ranked if c.valid_to is None or c.valid_to > ctx.now]


def drop_now_pages(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Leaves Now pages out of the channels: the response carries the owner's own apart."""
    return [c for c in ranked if not (c.layer == "l4_summary" and c.label == NOW_PAGE_LABEL)]


def drop_repeated_text(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Keeps the best-ranked row of each text; an L1 mirror takes its L3 fact's place."""
    kept: list[Candidate] = []
    slot_of: dict[str, int] = {}
    for candidate in ranked:
        key = content_key(candidate.content)
        slot = slot_of.get(key)
        if slot is None:
            slot_of[key] = len(kept)
            kept.append(candidate)
        elif candidate.layer == "l1_profile" and kept[slot].layer == "l3_fact":
            kept[slot] = candidate
    return kept


def knowledge_cap(limit: int) -> int:
    """The most l5_knowledge results a search of every layer returns (about 40%)."""
    return max(1, limit * 2 // 5)


def cap_knowledge(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Leaves room for other layers: lower-ranked L5 rows past the cap are dropped.

    Only when no layer was asked for; a search of L5 alone wants all of it.
    """
    if ctx.query.layers:
        return ranked
    room = knowledge_cap(ctx.query.limit)
    kept = []
    for candidate in ranked:
        if candidate.layer == "l5_knowledge":
            if room == 0:
                continue
            room -= 1
        kept.append(candidate)
    return kept


def own_session_intentions_first(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Reorders intentions among the places intentions hold, the caller's session first."""
    session = ctx.query.session_id
    if not session:
        return ranked
    slots = [i for i, c in enumerate(ranked) if c.layer == "l7_intention"]
    if len(slots) < 2:
        return ranked
    # sorted() is stable, so each group keeps its fused order.
    reordered = sorted((ranked[i] for i in slots), key=lambda c: c.session_id != session)
    out = list(ranked)
    for slot, candidate in zip(slots, reordered, strict=True):
        out[slot] = candidate
    return out


def truncate(ranked: list[Candidate], ctx: SearchContext) -> list[Candidate]:
    """Keeps the best `limit` results."""
    return ranked[: ctx.query.limit]
