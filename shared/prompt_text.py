"""How stored and said text goes into a prompt: a row on one line, what was said fenced as data.

A stored row or a turn is text anyone who talks to the agent may have written. Shown on one
line, a row cannot add lines that look like other numbered rows; fenced, a turn cannot close its
fence early and go on as the prompt's own words.
"""

from __future__ import annotations

import re


def one_line(text: str, most: int | None = None) -> str:
    """text with each run of whitespace (line breaks too) as one space, cut to most characters."""
    line = " ".join(text.split())
    return line if most is None else line[:most]


def fenced(text: str, tag: str) -> str:
    """text between a <tag> line and a </tag> line; a look-alike of either inside it is defused
    (its angle brackets become ‹ ›), so the text cannot end its fence."""
    look_alike = re.compile(rf"<(\s*/?\s*{re.escape(tag)}\b[^>]*)>", re.IGNORECASE)
    inside = look_alike.sub(lambda m: f"‹{m.group(1)}›", text)
    return f"<{tag}>\n{inside}\n</{tag}>"
