"""Turning a search answer into the text Hermes puts in <memory-context>, and turn text caps."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

CHANNEL_ORDER = ("now", "pages", "profile", "proactive", "experiences", "normal")
"""The order channels are shown in when the server does not send its own `order`."""

ITEM_CHARS = 400
OLD_VALUE_CHARS = 120
"""How much of a value a memory replaced its line shows."""
MESSAGE_CHARS = 4000
"""The most of one message a stored turn keeps (its head and tail), as the reference does."""
TURN_CHARS = 100_000
"""The most a stored turn holds: the server's limit on a text (MAX_TEXT_CHARS in
shared/limits.py). Messages are capped one by one, so only a turn joining the messages of
many turns Hermes did not sync comes near it."""

COMPACTION_PREFIXES = (
    "[CONTEXT COMPACTION",
    "[CONTEXT SUMMARY]",
    "[END OF PRIOR CONTEXT",
)
"""How Hermes's compaction summaries start; they are Hermes's own text, not the user's."""

_MEMORY_CONTEXT = re.compile(r"<\s*memory-context\s*>[\s\S]*?</\s*memory-context\s*>", re.I)
_FENCE_TAG = re.compile(r"</?\s*memory-context\s*>", re.I)
"""Hermes's fence around recall: Hermes cuts out all text between an opening and a closing
one, so a tag inside a stored memory would drop the recall lines after it."""


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _day(stamp: Any, utc_offset_minutes: Any = None) -> str:
    """The day of a stamp (unix seconds, or RFC 3339 as the gateway sends gmt_created) as its
    row's writer lived it: a UTC midnight is a date given without a time (dates are stored so),
    its own day; any other time is the day it fell on at utc_offset_minutes, the row's writer's
    clock (the rule of as_local_date and day in shared/dates.py, which the plugin, installed on
    its own, cannot import), or on this machine's clock from a server that sends no offset. ""
    when it is not a time (the gateway sends 0 for none)."""
    moment = _moment(stamp)
    if moment is None:
        return stamp[:10] if isinstance(stamp, str) and len(stamp) >= 10 else ""
    if moment.utcoffset() == dt.timedelta(0) and moment.time() == dt.time(0):
        return moment.date().isoformat()
    try:
        return moment.astimezone(_clock(utc_offset_minutes)).date().isoformat()
    except (OverflowError, ValueError):  # a day before the year 1 or after 9999 there
        return moment.date().isoformat()


def _clock(utc_offset_minutes: Any) -> dt.tzinfo | None:
    """The zone of a row's writer (its utc_offset_minutes, under a day either way); None, this
    machine's, for a row without one."""
    if isinstance(utc_offset_minutes, int) and not isinstance(utc_offset_minutes, bool):
        try:
            return dt.timezone(dt.timedelta(minutes=utc_offset_minutes))
        except ValueError:
            return None
    return None


def _moment(stamp: Any) -> dt.datetime | None:
    """A stamp as an aware time (UTC for unix seconds; before 1970 they are negative); None
    when it is none."""
    if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) and stamp != 0:
        try:
            return _EPOCH + dt.timedelta(seconds=stamp)
        except (OverflowError, ValueError):
            return None
    if isinstance(stamp, str):
        try:
            moment = dt.datetime.fromisoformat(stamp)
        except ValueError:
            return None
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=dt.UTC)
    return None


def _line(item: dict[str, Any], said: str) -> str:
    """One memory: the day it happened (else was recorded), its layer, and what it says."""
    offset = item.get("utc_offset_minutes")
    date = (_day(item.get("event_at"), offset) or _day(item.get("gmt_created"), offset)
            or "undated")
    layer = item.get("layer") or "memory"
    return f"- [{date}] ({layer}) {said}"


OldValue = tuple[str, str, frozenset[str] | None]
"""A value a recalled memory replaced: its text, the day it was replaced, and the ids of the
turns it was learnt from (None from a server that does not send them)."""


def _notes(item: dict[str, Any], old_values: list[OldValue]) -> str:
    """What a memory's line adds to its text: the values it replaced, each with the day it was
    replaced; for a turn, the replaced values among old_values it said; its due day."""
    notes = "".join(f' (replaced "{value}"' + (f" on {day})" if day else ")")
                    for value, day, _ in _old_values(item))
    if item.get("layer") == "l2_raw":
        marked: set[str] = set()
        for value, day, turns in old_values:
            if value not in marked and _said(item, value, turns):
                marked.add(value)
                notes += f" (no longer true{f' since {day}' if day else ''}: \"{value}\")"
    due = _day(item.get("due_at"), item.get("utc_offset_minutes"))
    return notes + (f" (due {due})" if due else "")


def _said(turn: dict[str, Any], value: str, learnt_from: frozenset[str] | None) -> bool:
    """Whether a recalled turn said a value since replaced: it is a turn the value was learnt
    from, or, from a server that does not name those turns, it holds the value's words."""
    if learnt_from is not None:
        return turn.get("memory_id") in learnt_from
    held = _words(value)
    return len(held) > 1 and held <= _words(str(turn["content"]))


def _old_values(item: dict[str, Any]) -> list[OldValue]:
    """The older values item replaced: each one's text, the day it was replaced (on item's
    writer's clock: the change is item's) and the turns it was learnt from."""
    offset = item.get("utc_offset_minutes")
    return [(_clip(old["content"], OLD_VALUE_CHARS), _day(old.get("invalid_at"), offset),
             frozenset(map(str, old["source_ids"]))
             if isinstance(old.get("source_ids"), list) else None)
            for old in item.get("replaced") or ()
            # A merged or restated row held the same value; only these held an older one.
            if isinstance(old, dict) and old.get("content")
            and old.get("superseded_how") in ("replaced", "updated")]


def _clip(text: str, limit: int) -> str:
    text = " ".join(_FENCE_TAG.sub("", str(text)).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _now_section(now: Any) -> str:
    """The owner's Now page with the day it was written (it may be days old); "" without one."""
    day = ""
    if isinstance(now, dict):
        day = _day(now.get("gmt_created"), now.get("utc_offset_minutes"))
        now = now.get("content") or now.get("text")
    if not isinstance(now, str) or not now.strip():
        return ""
    return (f"[NOW] (written {day})" if day else "[NOW]") + "\n" + _clip(now, 1200)


def format_recall(answer: dict[str, Any], query: str, per_channel: int) -> str:
    """The recalled memories grouped by channel, at most per_channel of each (the limit the
    search was asked for), each line with its date; "" when none.

    Each thing is said once: a line whose words another line or the Now page holds as well is
    left out, the fuller form kept. A turn where the user only asked to be told something, or
    asked about what the other lines say, is left out too (its answer came from memory, or was
    a guess).
    """
    memories = answer.get("memories") if isinstance(answer, dict) else None
    if not isinstance(memories, dict):
        return ""
    order = answer.get("order")
    channels = [c for c in order if isinstance(c, str)] if isinstance(order, list) else []
    channels += [c for c in CHANNEL_ORDER if c not in channels]
    channels += [c for c in memories if c not in channels]
    now = _now_section(answer.get("now"))
    items = [(channel, item) for channel in channels if isinstance(memories.get(channel), list)
             for item in memories[channel] if isinstance(item, dict) and item.get("content")]
    old_values = list(dict.fromkeys(old for _, item in items for old in _old_values(item)))
    shown = _without_repeats(_without_questions(
        [_shown(channel, item, old_values) for channel, item in items], now), now)
    sections = [now] if now else []
    for channel in channels:
        lines = [_line(item, said) for c, item, said, _ in shown if c == channel][:per_channel]
        if lines:
            sections.append(f"[{channel.upper()}]\n" + "\n".join(lines))
    if not sections:
        return ""
    head = (f'HyAtlas long-term memory for "{_clip(query, 80)}" '
            "(date = when it happened, else when it was recorded):")
    return head + "\n" + "\n\n".join(sections)


Shown = tuple[str, dict[str, Any], str, frozenset[str]]
"""A recalled memory: its channel, the item, what its line says and the words of what it
tells (of a turn, what the user said)."""

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_SENTENCE_OR_LINE_END = re.compile(r"(?<=[.!?])\s+|\n")
_WORD = re.compile(r"[^\W_]+")
STOP_WORDS = frozenset((
    "a", "an", "the", "and", "or", "but", "of", "to", "in", "on", "at", "for", "with", "from",
    "by", "as", "is", "are", "was", "were", "be", "been", "am", "do", "does", "did", "i", "me",
    "my", "mine", "you", "your", "yours", "he", "him", "his", "she", "her", "hers", "it", "its",
    "we", "us", "our", "they", "them", "their", "this", "that", "user", "assistant", "what",
    "where", "when", "who", "which", "why", "how", "now", "also", "still"))
"""Words that say nothing of what a memory holds ("user" and "assistant" name the speakers of
a turn and the subject of a fact; a question's words say what it asks about)."""
QUESTION_WORDS = ("what", "where", "when", "who", "whom", "whose", "which", "why", "how")
"""How a question asking to be told something starts (a request such as "Can you keep in
mind that …" may tell something itself)."""
NEGATIONS = frozenset(("not", "no", "never", "nor", "none", "nothing", "without", "don",
                       "doesn", "didn", "isn", "aren", "wasn", "weren", "won", "cannot"))
"""Words that turn what the rest of a line says around: a line holding another's words and
one of these says something else."""


def _shown(channel: str, item: dict[str, Any], old_values: list[OldValue]) -> Shown:
    """item as a recalled memory of channel."""
    notes = _notes(item, old_values)
    said = _users_part(item)
    return (channel, item, _clip(item["content"], ITEM_CHARS) + notes,
            _words((item["content"] if said is None else said) + notes))


def _users_part(item: dict[str, Any]) -> str | None:
    """What the user said in a stored turn; None when item is no turn."""
    content = str(item["content"])
    if item.get("layer") != "l2_raw" or not content.startswith("USER: "):
        return None
    return content[len("USER: "):].split("\n\nASSISTANT: ", 1)[0].strip()


def _without_questions(shown: list[Shown], now: str) -> list[Shown]:
    """shown without the turns where the user only asked to be told something (what, where,
    …) or asked about what the Now page and the other lines say; all of shown when nothing
    else is recalled.

    A question asking to be told something that names someone or something the Now page and
    the other lines do not ("Where should I take my daughter Lily?") stays: it tells that.
    """
    asked = [_asks_only(_users_part(entry[1])) for entry in shown]
    others = [e for e, question in zip(shown, asked, strict=True) if not question]
    if not others and not now:
        return shown
    told = _words(now).union(*(e[3] for e in others))
    return [e for e, question in zip(shown, asked, strict=True)
            if not question or not (e[3] <= told or (_asks_to_be_told(e)
                                                     and _names(e) <= told))]


def _asks_only(said: str | None) -> bool:
    """Whether said (what the user said in a turn) is questions only."""
    return bool(said) and all(s.endswith("?") for s in _SENTENCE_END.split(str(said)))


def _asks_to_be_told(entry: Shown) -> bool:
    """Whether a turn's user message starts as a question asking to be told something."""
    first = _WORD.findall(str(_users_part(entry[1])).lower())[:1]
    return bool(first) and first[0] in QUESTION_WORDS


def _names(entry: Shown) -> frozenset[str]:
    """The names in a turn's user message, as words: each word written with a capital past
    the first word of its sentence or line, but "I"."""
    return _words(" ".join(
        word for sentence in _SENTENCE_OR_LINE_END.split(str(_users_part(entry[1])))
        for word in _WORD.findall(sentence)[1:] if word[0].isupper() and word != "I"))


def _words(text: str) -> frozenset[str]:
    """What a text says, as words: any case, no stop words or single letters, a plural's s
    dropped."""
    words = (w.lower() for w in _WORD.findall(text))
    return frozenset(w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w
                     for w in words if (len(w) > 1 or w.isdigit()) and w not in STOP_WORDS)


def _without_repeats(shown: list[Shown], now: str) -> list[Shown]:
    """shown without a line whose words the Now page or another line holds too; of two lines
    holding each other's words, the one ranked first."""
    fuller = [_words(now)] if now else []
    kept: list[Shown] = []
    for entry in shown:
        if any(_holds(other, entry[3]) for other in [*fuller, *(e[3] for e in kept)]):
            continue
        kept = [e for e in kept if not _holds(entry[3], e[3])]
        kept.append(entry)
    return kept


def _holds(fuller: frozenset[str], words: frozenset[str]) -> bool:
    """Whether a line of words fuller says what a line of words says, and more."""
    return bool(words) and words <= fuller and not (fuller - words) & NEGATIONS


def clean_message(text: str) -> str:
    """A message's own text: no injected memory context, no compaction summary (not capped)."""
    if not isinstance(text, str):
        return ""
    text = _MEMORY_CONTEXT.sub("", text).strip()
    if text.startswith(COMPACTION_PREFIXES):
        return ""
    return text


def keep_ends(text: str, limit: int, *, say_how_much: bool = True) -> str:
    """text, or at most limit characters of it: its head and its tail, with a marker between
    them saying how many characters were left out (a bare "…" without say_how_much).

    A pasted log or trace says what matters at its end as often as at its start.
    """
    if len(text) <= limit:
        return text
    room = limit - len(_left_out(len(text), say_how_much))
    head = (room + 1) // 2
    tail = room - head
    return (text[:head] + _left_out(len(text) - room, say_how_much)
            + text[len(text) - tail:])


def _left_out(chars: int, say_how_much: bool) -> str:
    return f" … [{chars:,} characters left out] … " if say_how_much else " … "


def recall_query(text: str) -> str:
    """What recall searches for a message: its own text, its head and tail when it is long
    (no count of what was left out: words the search would look for)."""
    return keep_ends(clean_message(text), MESSAGE_CHARS, say_how_much=False)


def turn_text(said: list[str], assistant: str) -> str:
    """The text of one turn as stored: USER and ASSISTANT lines, the user's messages (said,
    oldest first) joined by blank lines, each message at most MESSAGE_CHARS and the turn at
    most TURN_CHARS, a longer one kept by its head and tail.

    Each message is capped on its own: capped as one, several joined messages lost a whole
    message between the first's head and the last's tail. "" when the user said nothing of
    their own (only injected context or a compaction summary).
    """
    user = "\n\n".join(keep_ends(text, MESSAGE_CHARS) for text in map(clean_message, said)
                        if text)
    if not user:
        return ""
    assistant = keep_ends(clean_message(assistant), MESSAGE_CHARS)
    text = f"USER: {user}" + (f"\n\nASSISTANT: {assistant}" if assistant else "")
    return keep_ends(text, TURN_CHARS)
