"""Entity pages (L8): their text, rendered from their metadata without the stale lines.

A page keeps its current state and its MAX_PAGE_HISTORY latest earlier states; an older one is
dropped when a new state pushes it out (the facts that fed it stay, with their own history).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any

MAX_PAGE_HISTORY = 20
"""The earlier states a page keeps, newest first: without a bound an entity that changes every
turn grows a page (and each extraction prompt showing it) until the embedder refuses it."""


def page_text(
    name: str, state: str, history: Sequence[Mapping[str, Any]], state_stale: bool = False
) -> str:
    """The page: its current state, then the dated earlier states; stale lines are left out."""
    lines = [name if state_stale else f"{name}: {state}"]
    live = [entry for entry in history if not entry.get("stale")]
    if live:
        lines.append("History:")
        lines.extend(f"- {entry['date']}: {entry['state']}" for entry in live)
    return "\n".join(lines)


def page_text_of(meta: Mapping[str, Any]) -> str:
    """The page a page row's metadata describes."""
    history = [h for h in meta.get("history", []) if isinstance(h, Mapping)]
    return page_text(
        str(meta.get("entity") or ""),
        str(meta.get("state") or ""),
        history,
        bool(meta.get("stale")),
    )


def mark_lines(meta: dict[str, Any], fact_id: str, dead: Set[str]) -> bool:
    """Marks each line fact_id fed stale iff one of its facts is dead; True if a mark changed.

    A line is the current state (the metadata's own "facts" and "stale") or a history entry.
    """
    changed = False
    lines = [meta, *(h for h in meta.get("history", []) if isinstance(h, dict))]
    for line in lines:
        facts = line.get("facts")
        if not isinstance(facts, list) or fact_id not in facts:
            continue
        mark = bool(dead & set(facts))
        if bool(line.get("stale")) != mark:
            if mark:
                line["stale"] = True
            else:
                line.pop("stale", None)
            changed = True
    return changed
