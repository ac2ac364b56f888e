"""What counts as "the same value" across services: one normaliser for every text comparison."""

from __future__ import annotations

import unicodedata


def value_key(text: str) -> str:
    """A value's key: NFKC, case-folded, punctuation dropped, whitespace collapsed."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    kept = "".join(ch if ch.isalnum() or ch.isspace() else " " for ch in folded)
    return " ".join(kept.split())
