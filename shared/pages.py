"""Entity pages (L8): their text, rendered from their metadata without the stale lines.

A page keeps its current state and its MAX_PAGE_HISTORY latest earlier states; an older one is
dropped when a new state pushes it out (the facts that fed it stay, with their own history).
A line goes stale with the rows it rests on; a page left with no live line is retired as stale.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence, Set
from typing import Any

from shared.text import value_key

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


def current_state(content: str, meta: Mapping[str, Any]) -> str:
    """A page's current state: its metadata's, unless its text is not the page the metadata
    describes (a user edited it): then the edited text's first line, less the entity's name."""
    state = str(meta.get("state") or "")
    if not content.strip() or content == page_text_of(meta):
        return state
    first = content.strip().split("\n", 1)[0].strip()
    name = str(meta.get("entity") or "")
    if name and first.startswith(f"{name}:"):
        first = first[len(name) + 1 :].strip()
    return first or state


def lines_of(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """A page's lines: the current state (the metadata itself) and its history entries."""
    return [meta, *(h for h in meta.get("history", []) if isinstance(h, dict))]


def meta_of(metadata_json: str) -> dict[str, Any]:
    """A page's metadata object ({} when unreadable)."""
    try:
        meta = json.loads(metadata_json or "{}")
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def line_values(meta: dict[str, Any], live_only: bool = False) -> set[str]:
    """The value keys of a page's lines: each state, and each as "entity: state"."""
    name = str(meta.get("entity") or "")
    states = [
        str(line.get("state") or "")
        for line in lines_of(meta)
        if not (live_only and line.get("stale"))
    ]
    return {v for state in states for v in state_values(name, state)}


def state_values(name: str, state: str) -> set[str]:
    """The value keys a page line holds: its state, and "entity: state" as the page shows it
    (a forget of either takes the line)."""
    return {value_key(state), value_key(f"{name}: {state}")}


def rests_on(meta: dict[str, Any], live_only: bool = False) -> list[str]:
    """Every row a line of the page (a live line, with live_only) rests on, in order, once."""
    lines = [line for line in lines_of(meta) if not (live_only and line.get("stale"))]
    return list(dict.fromkeys(i for line in lines for i in sorted(cited_by(line))))


def cited_by(line: Mapping[str, Any]) -> set[str]:
    """The rows a line rests on: the facts naming its entity ("facts"), its turn and every fact
    extracted from that turn ("rests_on")."""
    return {
        str(i)
        for key in ("facts", "rests_on")
        if isinstance(line.get(key), list)
        for i in line[key]
    }


def mark_lines(
    meta: dict[str, Any], memory_id: str, dead: Set[str], gone: Set[str], outdated: Set[str]
) -> bool:
    """Marks each line memory_id fed stale iff one of its facts is dead (retired in a way that
    takes what rests on it down) or one of the rows it rests on is gone (forgotten or deleted,
    so its value may not stay in the page). A fact outdated (replaced or updated by a newer
    version) hides the current state only: an earlier state is the past, and a newer fact is
    why it is history (its line went stale as the page's update made it history, and "what
    changed" lost it). True if a mark changed."""
    changed = False
    for i, line in enumerate(lines_of(meta)):
        if memory_id not in cited_by(line):
            continue
        facts = set(line.get("facts") or ()) - (outdated if i else set())
        mark = bool(dead & facts or gone & set(line.get("rests_on") or ()))
        if bool(line.get("stale")) != mark:
            if mark:
                line["stale"] = True
            else:
                line.pop("stale", None)
            changed = True
    return changed


def has_live_line(meta: dict[str, Any]) -> bool:
    """Whether any line of the page is not stale (a page with none is retired)."""
    return any(not line.get("stale") for line in lines_of(meta))
