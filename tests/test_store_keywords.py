"""How many query terms a text holds, against stemming every word of the text."""

from __future__ import annotations

import re
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from services.store import keywords
from services.store.keywords import matched_terms, query_terms, stem

WORDS = [
    "walk", "walking", "walked", "walks", "happy", "happiness", "happier", "ponies", "pony",
    "relational", "relate", "generously", "generous", "running", "runner", "run", "ran", "sky",
    "skies", "cats", "catalogue", "agreed", "agree", "hoping", "hopping", "hope", "dancing",
    "dance", "2024", "x1", "naïve", "café", "über", "straße",
]
words = st.one_of(st.sampled_from(WORDS), st.text("abcdeilnorsty", min_size=2, max_size=9))
gaps = st.sampled_from([" ", ", ", "'", "_", "-", "3", ". ", "é", "\n"])


@st.composite
def texts(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.tuples(words, gaps), max_size=12))
    text = "".join(word + gap for word, gap in parts)
    return text.upper() if draw(st.booleans()) else text


@settings(max_examples=2000)
@given(text=texts(), terms=st.lists(words, max_size=5))
def test_a_text_holds_the_terms_one_of_its_words_stems_to(text: str, terms: list[str]) -> None:
    # A word is a run of letters and digits, as the keyword index's tokenizer splits them.
    held = {stem(word) for word in re.findall(r"[^\W_]+", text.lower())}
    term_stems = [stem(term) for term in terms]
    assert matched_terms(term_stems, text) == sum(s in held for s in term_stems)


MARKED = ["हिन्दी", "किताबें", "पढ़ना", "ภาษาไทย", "ที่นี่", "naïve", "e\u0301te\u0301"]


@settings(max_examples=1000)
@given(
    parts=st.lists(st.tuples(st.one_of(st.sampled_from(MARKED), words), gaps), max_size=10),
    terms=st.lists(st.one_of(st.sampled_from(MARKED), words), max_size=4),
)
def test_a_word_with_combining_marks_is_matched_whole(
    parts: list[tuple[str, str]], terms: list[str]
) -> None:
    text = "".join(word + gap for word, gap in parts)
    held = {stem(word) for word in keywords._words().findall(text.lower())}
    term_stems = [stem(term) for term in query_terms(" ".join(terms))]  # a query's words
    assert matched_terms(term_stems, text) == sum(s in held for s in term_stems)


def test_a_word_character_is_one_the_word_pattern_matches() -> None:
    pattern = re.compile(keywords._word_char())
    differ = [
        hex(point) for point in range(sys.maxunicode + 1)
        if (pattern.fullmatch(chr(point)) is not None) != keywords.is_word_char(chr(point))
    ]
    assert differ == []
