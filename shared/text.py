"""What counts as "the same" across services: one normaliser for each kind of text compared."""

from __future__ import annotations

import unicodedata


def value_key(text: str) -> str:
    """A value's key: NFKC, case-folded, punctuation dropped, whitespace collapsed."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    kept = "".join(ch if ch.isalnum() or ch.isspace() else " " for ch in folded)
    return " ".join(kept.split())


def content_key(text: str) -> str:
    """A memory's text as two are compared for repeats: lower case, runs of whitespace as one."""
    return " ".join(text.lower().split())


def name_key(name: str) -> str:
    """A graph node's or relation's name as it is compared: case-folded by Unicode's rules, so
    "Émile" and "émile" name one entity in every service and on both store backends (SQL's
    lower() folds ASCII alone in SQLite, and follows the database's locale in PostgreSQL)."""
    return name.casefold()


def edge_key(subject: str, relation: str, obj: str) -> tuple[str, str, str]:
    """An edge's names as they are compared (name_key)."""
    return name_key(subject), name_key(relation), name_key(obj)
