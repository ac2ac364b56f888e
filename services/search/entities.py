"""Names a query mentions: capitalised words and phrases, quoted strings, and known entities."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

# Capitalised words that open or fill a question without naming anything.
COMMON_CAPITALISED = frozenset(
    {
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "but",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "for",
        "from",
        "had",
        "has",
        "have",
        "he",
        "her",
        "his",
        "how",
        "i",
        "if",
        "in",
        "is",
        "it",
        "its",
        "may",
        "me",
        "might",
        "my",
        "no",
        "not",
        "of",
        "on",
        "or",
        "our",
        "she",
        "should",
        "so",
        "that",
        "the",
        "their",
        "them",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "to",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "whether",
        "which",
        "who",
        "whom",
        "whose",
        "why",
        "will",
        "with",
        "would",
        "yes",
        "you",
        "your",
        "tell",
        "list",
        "name",
        "give",
        "show",
        "find",
        "remind",
        "please",
        "describe",
        "explain",
        "recall",
        "remember",
        "any",
        "all",
        "some",
        "both",
        "each",
        "every",
        "after",
        "before",
        "during",
        "since",
        "until",
        "about",
        "also",
        "besides",
        "other",
        "ok",
        "okay",
        "hi",
        "hello",
        "hey",
        "thanks",
        "today",
        "yesterday",
        "tomorrow",
        "last",
        "next",
        "ever",
        "monday",
        "tuesday",
        "wednesday",
        "thursday",
        "friday",
        "saturday",
        "sunday",
        "january",
        "february",
        "march",
        "april",
        "june",
        "july",
        "august",
        "september",
        "october",
        "november",
        "december",
        "would've",
        "could've",
        "should've",
    }
)
_WORD = r"[A-Z][\w&.\-]*(?:'s)?"
_CAPITALISED_RUN = re.compile(rf"\b{_WORD}(?:\s+(?:of\s+|the\s+|de\s+)?{_WORD})*")
_QUOTED = re.compile(r"[\"“]([^\"”]{2,60})[\"”]")
_POSSESSIVE = re.compile(r"'s$")


def _clean(name: str) -> str:
    return _POSSESSIVE.sub("", name.strip().strip(".-")).strip()


def _capitalised_runs(text: str) -> Iterator[list[str]]:
    """Each run of capitalised words in reading order, as its words that may be names (common
    words and single letters left out); runs with none are skipped."""
    for match in _CAPITALISED_RUN.finditer(text):
        words = [_clean(w) for w in match[0].split()]
        words = [w for w in words if w and w.lower() not in COMMON_CAPITALISED and len(w) > 1]
        if words:
            yield words


def subject_of(query: str) -> str | None:
    """The first name a query holds, in reading order: whom a question is most likely about
    ("what does Ana think of Ben's plan?" is about Ana)."""
    return next((words[0] for words in _capitalised_runs(query)), None)


def speaker_pattern(name: str) -> re.Pattern[str]:
    """The pattern of a transcript line said by name: the text opens with "Name:"."""
    return re.compile(rf"\s*{re.escape(name)}\s*:", re.IGNORECASE)


MOST_QUERY_NAMES = 32
"""The names a query is searched by at most (the longest): each costs a pattern run over every
candidate, and a long capitalised text would hold thousands."""


def query_entities(query: str, known: Iterable[str] = ()) -> list[str]:
    """The names a query mentions, longest first, without repeats, at most MOST_QUERY_NAMES.

    A capitalised word counts unless it is a common word (a question word opening the query is
    not a name); runs of capitalised words count as one name and as each of their words, so
    "Lake Tahoe" also finds a memory that says only "Tahoe". Known entity names (from L8 pages)
    count wherever the query holds them, in any case.
    """
    names: list[str] = []
    for match in _QUOTED.finditer(query):
        names.append(match[1].strip())
    for words in _capitalised_runs(query):
        if len(words) > 1:
            names.append(" ".join(words))
        names.extend(words)
    lowered = query.lower()
    for entity in known:
        entity = entity.strip()
        if len(entity) > 1 and re.search(rf"\b{re.escape(entity.lower())}\b", lowered):
            names.append(entity)
    unique = list(dict.fromkeys(n for n in names if n))
    return sorted(unique, key=len, reverse=True)[:MOST_QUERY_NAMES]


def mention_pattern(name: str) -> re.Pattern[str]:
    """The pattern that finds a name in a text: whole words, any case."""
    return re.compile(rf"(?<!\w){re.escape(name)}(?!\w)", re.IGNORECASE)


def mentions(text: str, name: str) -> bool:
    """Whether a text names an entity: a whole-word, case-insensitive match."""
    return mention_pattern(name).search(text) is not None
