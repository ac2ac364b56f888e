"""What a search can switch off by name (HYATLAS_SEARCH_DISABLE_STAGES, a request's
skip_stages): the full ranking's stages in the order they run, and two retrieval features.

Kept apart from the ranking, so that the gateway lists them without loading it (the stages and
numpy: about 20 MiB of the gateway's memory).
"""

from __future__ import annotations

GRAPH = "graph"
"""The stage name that switches graph-assisted recall off (retrieval and ranking both)."""

CONTEXT_KEYS = "context_keys"
RELAXED_KEYWORDS = "relaxed_keywords"
RETRIEVAL_SWITCHES = (CONTEXT_KEYS, RELAXED_KEYWORDS)
"""Retrieval features that are switched off like stages but act before the ranking runs."""

FULL_RANKING = (
    "fuse",
    GRAPH,
    "dates",
    "times",
    "entities",
    "speaker",
    "first_person",
    "recency",
    "usage",
    "ended",
    "intention_ttl",
    "now_apart",
    "dedupe",
    "near_duplicates",
    "sittings",
    "replies",
    "mmr",
    "replaced_turns",
    "l5_cap",
    "session_intentions",
    "truncate",
)
"""The full ranking's stages in the order they run (pipeline.LITE_PIPELINE)."""

ALWAYS_ON = frozenset({"fuse"})
"""Fusion makes the ranking; without it there is nothing for the other stages to order."""


def switchable_names() -> tuple[str, ...]:
    """Every name HYATLAS_SEARCH_DISABLE_STAGES and a request's skip_stages accept."""
    return (*(n for n in FULL_RANKING if n not in ALWAYS_ON), *RETRIEVAL_SWITCHES)
