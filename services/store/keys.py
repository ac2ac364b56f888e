"""Extra search keys of a memory: its sentences, its place in the conversation, and for a turn
what was learnt from it.

A key is a text that is embedded and indexed like the memory's own, but a hit on it returns the
memory itself; the key's text is never shown.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from shared.limits import MAX_TEXT_CHARS
from shared.passages import Passage, spans_of

CLAUSE = "clause"
CONTEXT = "context"
FACT = "fact"
# The kinds of key that have a vector (a context key is found by its words only).
VECTOR_KINDS = frozenset({CLAUSE, FACT})
KINDS = (CLAUSE, CONTEXT, FACT)

# A memory this long or longer is also indexed under its sentences: under each while it has at
# most MAX_CLAUSES of them, else under MAX_CLAUSES runs of adjacent sentences. Each key is a
# vector the index holds in memory and on disk; past two, LoCoMo's hybrid gains little (README).
CLAUSE_MIN_CHARS = 160
CLAUSE_MIN_WORDS = 4
MAX_CLAUSES = 2
# Memories written before sentences were grouped into runs hold up to this many sentence keys.
MOST_CLAUSES_HELD = 12
# A neighbour contributes at most this much text to a context key.
NEIGHBOUR_CHARS = 400
MAX_KEY_CHARS = MAX_TEXT_CHARS + 2 * (NEIGHBOUR_CHARS + 1)
"""The longest key: a context key holds its memory and a line of each neighbour's text."""
# A write this long after the one before starts a new sitting: they are not each other's context.
NEIGHBOUR_GAP_S = 6 * 3600.0
# Layers whose rows are turns of a conversation, so their neighbours are context.
CONTEXT_LAYERS = frozenset({"l2_raw"})
# Layers of what is learnt from a turn: such a row that cites turns (source_ids) is also a key
# of each of them, with its own text and vector, so a turn is found by its facts' words too.
FACT_KEY_LAYERS = frozenset({"l3_fact", "l7_intention"})

_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+(?=[\"'(\[]?[A-Z0-9])|\n+")


@dataclass(frozen=True, slots=True)
class KeyText:
    """One extra key: what kind it is and the text embedded for it."""

    kind: str
    text: str


def clauses(content: str) -> list[str]:
    """The sentences, or runs of sentences, a long memory is also found by; none for a short
    one."""
    text = content.strip()
    if len(text) < CLAUSE_MIN_CHARS:
        return []
    parts = [p.strip() for p in _SENTENCE_END.split(text)]
    parts = [p for p in parts if len(p.split()) >= CLAUSE_MIN_WORDS]
    if len(parts) < 2:
        return []
    return _runs(text, parts, MAX_CLAUSES)


def _runs(text: str, parts: list[str], most: int) -> list[str]:
    """The parts as at most `most` runs of adjacent parts, each the text from its first part to
    its last, cut where the runs' lengths come nearest to even."""
    if len(parts) <= most:
        return parts
    spans = spans_of(text, parts)
    reach = list(itertools.accumulate(end - start for start, end in spans))
    cuts: list[int] = []
    for run in range(1, most):
        share = reach[-1] * run / most
        first = cuts[-1] + 1 if cuts else 0
        last = len(spans) - (most - run) - 1
        cuts.append(min(range(first, last + 1), key=lambda i: abs(reach[i] - share)))
    ends = zip([-1, *cuts], [*cuts, len(spans) - 1], strict=True)
    return [text[spans[after + 1][0] : spans[end][1]] for after, end in ends]


def _trim(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= NEIGHBOUR_CHARS else text[:NEIGHBOUR_CHARS].rsplit(" ", 1)[0]


def context_text(before: str | None, content: str, after: str | None) -> str:
    """A memory with the turns around it (just its own text while it has none)."""
    parts = [_trim(before)] if before is not None else []
    parts.append(" ".join(content.split()))
    if after is not None:
        parts.append(_trim(after))
    return "\n".join(parts)


def own_keys(content: str) -> list[KeyText]:
    """The keys a memory gets from its own text."""
    return [KeyText(CLAUSE, clause) for clause in clauses(content)]


def passage_of(content: str) -> Passage:
    """A memory's text with its clauses as spans: one model run embeds them all, in the order
    own_keys gives them."""
    return Passage(content, spans_of(content, clauses(content)))
