"""How a keyword query becomes terms, and how many of them a row must contain."""

from __future__ import annotations

import math
import re

STOP_WORDS = frozenset(
    {
        "a", "about", "an", "and", "are", "as", "at", "be", "been", "but", "by", "can", "could",
        "did", "do", "does", "for", "from", "had", "has", "have", "he", "her", "him", "his", "how",
        "i", "if", "in", "into", "is", "it", "its", "me", "my", "of", "on", "or", "our", "she",
        "should", "so", "than", "that", "the", "their", "them", "then", "there", "these", "they",
        "this", "to", "us", "was", "we", "were", "what", "when", "where", "which", "who", "whom",
        "why", "will", "with", "would", "you", "your",
        # What contractions leave behind ("we'll", "they're", "I've").
        "ll", "re", "ve",
    }
)
# Letters and digits only: the FTS5 unicode61 tokenizer splits on everything else, underscore too.
_WORD = re.compile(r"[^\W_]+")


def query_terms(query: str) -> list[str]:
    """The distinct lowercase words of a query, stop words and single characters removed."""
    words = (w for w in _WORD.findall(query.lower()) if len(w) > 1 and w not in STOP_WORDS)
    return list(dict.fromkeys(words))


def required_terms(n: int) -> int:
    """Up to three terms must all match; beyond that, three quarters of them (rounded up)."""
    return n if n <= 3 else math.ceil(0.75 * n)
