"""How a keyword query becomes terms, how many a row must contain, and which find rows."""

from __future__ import annotations

import functools
import math
import re
import sys
import unicodedata
from collections.abc import Sequence

import Stemmer
import tantivy

from shared.text import STOP_WORDS


@functools.cache
def _marks_in_words() -> frozenset[str]:
    """The combining marks a word holds besides letters and digits, as the keyword indexes split
    text: the ones Unicode counts as alphabetic (a Devanagari vowel sign, not its virama), which
    Python's \\w leaves out, found as the ones tantivy's tokenizer keeps in a word."""
    marks = [chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c))[0] == "M"]
    kept = set(tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple()).build().analyze(
        " ".join(f"a{mark}a" for mark in marks)
    ))
    return frozenset(mark for mark in marks if f"a{mark}a" in kept)


@functools.cache
def _word_char() -> str:
    """What a word is made of, as a pattern: letters and digits, and _marks_in_words."""
    return rf"(?:[^\W_]|[{''.join(sorted(_marks_in_words()))}])"


@functools.cache
def _words() -> re.Pattern[str]:
    return re.compile(_word_char() + "+")


def is_word_char(char: str) -> bool:
    """Whether a character belongs to a word (see _word_char; [^\\W_] is str.isalnum's set, and
    a match of the pattern by re's own cache of patterns, which others push it out of, took a
    keyword search about a millisecond)."""
    return char.isalnum() or char in _marks_in_words()


def query_terms(query: str) -> list[str]:
    """The distinct lowercase words of a query, stop words and single characters removed."""
    words = (w for w in _words().findall(query.lower()) if len(w) > 1 and w not in STOP_WORDS)
    return list(dict.fromkeys(words))


def required_terms(n: int) -> int:
    """Up to three terms must all match; beyond that, three quarters of them (rounded up)."""
    return n if n <= 3 else math.ceil(0.75 * n)


# A relaxed search reads at most about this many postings of its owner: beyond it, only the
# rarest terms find rows, and only among the newest of them.
POSTING_BUDGET = 2000

_STEMMER = Stemmer.Stemmer("english")


def stem(word: str) -> str:
    """A word's stem, as the keyword indexes make it (Snowball English)."""
    return str(_STEMMER.stemWord(word.lower()))


@functools.lru_cache(maxsize=4096)
def _words_from(term_stem: str) -> re.Pattern[str]:
    # Stemming changes only a word's ending, so every word with this stem starts with the stem
    # less its last letter (happy -> happi, ponies -> poni, ay -> ai). The pattern starts with
    # those letters, so the regex engine looks for them as a plain string (a lookbehind first
    # made it try every position: three times slower on long texts). It goes on over letters
    # and digits; _words_like takes a word on over marks (with them in the pattern, each new
    # term's pattern took about 0.9 ms to compile).
    return re.compile(re.escape(term_stem[:-1]) + r"[^\W_]*")


def _word_end(text: str, at: int) -> int:
    """Where the word running at position at ends."""
    while at < len(text) and is_word_char(text[at]):
        at += 1
    return at


def _words_like(term_stem: str, lower: str) -> list[str]:
    """The words of a lowercase text that start with the letters every word of this stem
    starts with (a match inside a word is not one)."""
    return [
        lower[found.start():_word_end(lower, found.end())]
        for found in _words_from(term_stem).finditer(lower)
        if found.start() == 0 or not is_word_char(lower[found.start() - 1])
    ]


def matched_terms(term_stems: Sequence[str], text: str) -> int:
    """How many of the query's (stemmed) terms a text holds: only words that could carry a
    term's stem are stemmed."""
    lower = text.lower()
    held = 0
    for term_stem in term_stems:
        if term_stem[:-1] not in lower:
            continue
        words = _words_like(term_stem, lower)
        if words and term_stem in _STEMMER.stemWords(words):
            held += 1
    return held


def idf(rows: int, postings: int) -> float:
    """bm25's inverse document frequency of a term held by `postings` of `rows` rows: the
    weight a relaxed keyword search gives a row for holding the term (both backends)."""
    rows = max(rows, postings)
    return math.log(1 + (rows - postings + 0.5) / (postings + 0.5))


def finding_terms(
    postings: Sequence[int], least: int, budget: int, *, rarest: bool = True
) -> list[int]:
    """Which terms find candidate rows (indices into postings, each term's owner postings).

    A row holding `least` of n terms holds one of the n - least + 1 rarest, so those always
    find rows (unless rarest is False: then only terms within the budget do); rarer terms
    beyond them join while the postings read stay within the budget. Leaving out a common
    term loses no row that `least` counts, only a little of its score.
    """
    order = sorted(range(len(postings)), key=lambda i: postings[i])
    needed = len(postings) - least + 1 if rarest else 0
    chosen = order[:needed]
    read = sum(postings[i] for i in chosen)
    for i in order[needed:]:
        if read + postings[i] > budget:
            break
        chosen.append(i)
        read += postings[i]
    return chosen
