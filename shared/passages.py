"""A text to embed together with spans of it (its sentences) that get vectors of their own.

With HYATLAS_EMBED_POOLED_SPANS on (the default), a model that pools token states (mean
pooling) gives a span the mean of its tokens' states from the text's one run: the sentence in
its context, at no extra model run. Otherwise (and for any other model) the span's text is
embedded on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Passage:
    """A text and the (start, end) character spans of it to embed as well."""

    text: str
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def rows(self) -> int:
        """How many vectors it gets: the text's, then one per span."""
        return 1 + len(self.spans)

    def span_texts(self) -> list[str]:
        """The text of each span."""
        return [self.text[start:end] for start, end in self.spans]


def row_texts(passages: Sequence[Passage]) -> list[str]:
    """Each row's text in order (a passage, then its spans), for a model that embeds texts only."""
    return [text for p in passages for text in (p.text, *p.span_texts())]


def spans_of(text: str, parts: Sequence[str]) -> tuple[tuple[int, int], ...]:
    """Where each part lies in text, searched in order (a part not found is a ValueError)."""
    spans, at = [], 0
    for part in parts:
        start = text.index(part, at)
        spans.append((start, start + len(part)))
        at = start + len(part)
    return tuple(spans)
