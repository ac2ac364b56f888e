"""What counts as "the same" across services: one normaliser for each kind of text compared."""

from __future__ import annotations

import unicodedata


def value_key(text: str) -> str:
    """A value's key: NFKC, case-folded, punctuation dropped, whitespace collapsed."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    kept = "".join(ch if ch.isalnum() or ch.isspace() else " " for ch in folded)
    return " ".join(kept.split())


# Words too common to tell texts apart: left out of keyword queries, and of the words compared
# when two texts may hold one value.
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

# Words that turn a statement around (value_key splits "don't" into "don" and "t").
NEGATIONS = frozenset({"not", "no", "never", "t", "nor", "neither", "none", "nothing", "cannot"})
# How far a value's words may spread in a longer text: a value of n words within 2n + SPREAD.
SPREAD = 2


def may_restate(one: str, other: str) -> bool:
    """Whether two texts may hold one value however near their vectors are. The words of the
    shorter (value_key's, less STOP_WORDS) must follow in the longer in order, none added among
    them holding a digit or a negation, and no negation in the two words before them: so "I
    like hiking" and "I really like hiking" may, and texts with another number or time ("3pm"
    / "4pm"), another word in a word's place ("blue" / "red"), their words in another order or
    a "not" more hold another value. Words around them (the rest of a longer note) do not
    count."""
    short, long = sorted((_value_words(one), _value_words(other)), key=len)
    if not short:
        return False
    return any(_follows(short, long, at) for at, word in enumerate(long) if word == short[0])


def _value_words(text: str) -> list[str]:
    return [word for word in value_key(text).split() if word not in STOP_WORDS]


def _follows(short: list[str], long: list[str], start: int) -> bool:
    """Whether short's words follow in long from start, as may_restate asks."""
    if any(word in NEGATIONS for word in long[max(0, start - 2) : start]):
        return False
    matched = 0
    for word in long[start : start + 2 * len(short) + SPREAD]:
        if word == short[matched]:
            matched += 1
            if matched == len(short):
                return True
        elif word in NEGATIONS or _has_digit(word):
            return False
    return False


# Words naming a number, each as the digits it names ("one" left out: mostly a pronoun).
NUMBER_WORDS = {
    "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7", "eight": "8",
    "nine": "9", "ten": "10", "eleven": "11", "twelve": "12", "dozen": "12", "twenty": "20",
    "thirty": "30", "forty": "40", "fifty": "50", "hundred": "100", "thousand": "1000",
    "million": "1000000", "once": "1", "twice": "2", "first": "1st", "second": "2nd",
    "third": "3rd", "half": "half",
}


def may_repeat(one: str, other: str) -> bool:
    """Whether one text may say again, in other words, what the other says: both name the same
    numbers (words holding a digit, or NUMBER_WORDS: "three" and "3" are one) and hold as many
    negations. Looser than may_restate, which also wants the same words in order: for what a
    model words anew each time (a pattern drawn from facts), where a near vector mostly means
    one meaning unless a number or a "not" tells the two apart ("runs 3 times a week" / "5
    times", "is vegetarian" / "is not vegetarian")."""
    words = value_key(one).split(), value_key(other).split()
    numbers = [{NUMBER_WORDS.get(w, w) for w in said if _names_number(w)} for said in words]
    negations = [sum(w in NEGATIONS for w in said) for said in words]
    return numbers[0] == numbers[1] and negations[0] == negations[1]


def _names_number(word: str) -> bool:
    return word in NUMBER_WORDS or _has_digit(word)


def _has_digit(word: str) -> bool:
    return any(ch.isdigit() for ch in word)


def may_name_one_entity(one: str, other: str) -> bool:
    """Whether two names may name one entity: they share a word (value_key's, less STOP_WORDS),
    as "Leo" and "Leo Rossi" do and "Leo" and "Acme" do not."""
    return bool(set(_value_words(one)) & set(_value_words(other)))


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
