"""Reading model output: a tolerant JSON parser and the ops it may name, checked."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from shared.dates import parse_date
from shared.llm import shown_number
from shared.pb import common_pb2

log = logging.getLogger(__name__)

_PREFERENCES = "user_preferences"
# Labels a fact may carry; anything else the model invents is kept as no label.
FACT_LABELS = frozenset({_PREFERENCES, "user_info", "project", "event", "decision", "other"})
MAX_ITEM_CHARS = 2_000
"""The longest text a reply's item may hold (a fact is one statement, a state a sentence or two):
a longer one is dropped, not stored."""
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Candidate:
    """A stored row shown to the model under a short local number."""

    number: int
    kind: str  # fact | intention | page
    memory: common_pb2.Memory


@dataclass
class FactOp:
    """A new fact, and the shown facts it replaces or updates."""

    text: str
    event_at: float | None = None
    label: str = ""
    replaces: list[common_pb2.Memory] = field(default_factory=list)
    updates: common_pb2.Memory | None = None


@dataclass
class IntentionOp:
    """A new open intention."""

    text: str
    due_at: float | None = None


@dataclass
class PageOp:
    """The current state of one entity, for its page."""

    name: str
    state: str
    kind: str = ""
    page: common_pb2.Memory | None = None


@dataclass
class Plan:
    """What one extraction reply asks for, after every number was checked."""

    facts: list[FactOp] = field(default_factory=list)
    intentions: list[IntentionOp] = field(default_factory=list)
    done: list[common_pb2.Memory] = field(default_factory=list)
    moved_on: list[common_pb2.Memory] = field(default_factory=list)
    pages: list[PageOp] = field(default_factory=list)
    experiences: list[str] = field(default_factory=list)
    dropped: int = 0
    """Ops (and numbers a fact replaces) dropped because they named a number that was not shown
    (or of another kind)."""


class _Unknown(Exception):
    """An op named a number the model was not shown."""


def _items(data: dict[str, Any], key: str) -> list[Any]:
    value = data.get(key)
    return value if isinstance(value, list) else []


def _text(value: Any) -> str:
    return " ".join(value.split()) if isinstance(value, str) else ""


def read_plan(data: dict[str, Any], shown: dict[int, Candidate], instructions: str = "") -> Plan:
    """Turns a reply into a Plan; an op naming an unknown number (of the ones a fact replaces
    or updates, that number alone), or a text too long or made of the instructions' own words
    only, is dropped and counted."""
    reader = _PlanReader(shown, instructions)
    reader.facts(data)
    reader.intentions(data)
    reader.entities(data)
    for item in _items(data, "experiences"):
        text = _text(item.get("text")) if isinstance(item, dict) else _text(item)
        if text and reader.usable("experience", text, item):
            reader.plan.experiences.append(text)
    return reader.plan


def _numbers(value: Any) -> list[Any]:
    if value is None or value == "":
        return []
    return value if isinstance(value, list) else [value]


class _PlanReader:
    """Reads one reply's ops; only numbers that were shown, of the right kind, pass."""

    def __init__(self, shown: dict[int, Candidate], instructions: str) -> None:
        self.shown = shown
        self.plan = Plan()
        self.instruction_words = frozenset(_WORD.findall(instructions.casefold()))

    def pick(self, value: Any, kind: str) -> common_pb2.Memory:
        number = shown_number(value)
        if number is None:
            raise _Unknown(value)
        candidate = self.shown.get(number)
        if candidate is None or candidate.kind != kind:
            raise _Unknown(value)
        return candidate.memory

    def shown_facts(self, item: dict[str, Any], key: str) -> list[common_pb2.Memory]:
        """The shown facts a fact's replaces or updates names: a number not shown (an id the
        model could not know, another kind's) is dropped and counted alone, the fact and the
        rest stand."""
        facts = []
        for value in _numbers(item.get(key)):
            try:
                facts.append(self.pick(value, "fact"))
            except _Unknown:
                self.drop(f"fact's {key}", item, f"naming {value!r}, which was not shown")
        return facts

    def drop(self, what: str, item: Any, why: str = "naming a number that was not shown") -> None:
        self.plan.dropped += 1
        log.warning("dropped a %s op %s: %.200r", what, why, item)

    def usable(self, what: str, text: str, item: Any) -> bool:
        """Whether a text the model wrote may be stored: at most MAX_ITEM_CHARS, and holding a
        word the instructions do not (a small model echoes the reply template's placeholders,
        "one self-contained statement"); else the op is dropped and counted."""
        if len(text) > MAX_ITEM_CHARS:
            self.drop(what, item, f"whose text is over {MAX_ITEM_CHARS:,} characters")
            return False
        if self.instruction_words and set(_WORD.findall(text.casefold())) <= self.instruction_words:
            self.drop(what, item, "holding only the instructions' own words")
            return False
        return True

    def facts(self, data: dict[str, Any]) -> None:
        for item in _items(data, "facts"):
            if isinstance(item, str):
                item = {"text": item}
            if not isinstance(item, dict) or not _text(item.get("text")):
                continue
            if not self.usable("fact", _text(item["text"]), item):
                continue
            label = _text(item.get("label"))
            self.plan.facts.append(
                FactOp(
                    text=_text(item["text"]),
                    event_at=parse_date(item.get("event_at")),
                    label=label if label in FACT_LABELS else "",
                    replaces=self.shown_facts(item, "replaces"),
                    updates=next(iter(self.shown_facts(item, "updates")), None),
                )
            )

    def intentions(self, data: dict[str, Any]) -> None:
        for item in _items(data, "intentions"):
            if isinstance(item, str):
                item = {"text": item}
            if isinstance(item, dict) and _text(item.get("text")):
                if not self.usable("intention", _text(item["text"]), item):
                    continue
                self.plan.intentions.append(
                    IntentionOp(_text(item["text"]), parse_date(item.get("due_at")))
                )
        closed = (("intentions_done", self.plan.done), ("intentions_moved_on", self.plan.moved_on))
        for key, target in closed:
            for value in _items(data, key):
                try:
                    target.append(self.pick(value, "intention"))
                except _Unknown:
                    self.drop(key, value)

    def entities(self, data: dict[str, Any]) -> None:
        for item in _items(data, "entities"):
            if not isinstance(item, dict):
                continue
            if not _text(item.get("name")) or not _text(item.get("state")):
                continue
            if len(_text(item["name"])) > MAX_ITEM_CHARS:
                self.drop("entity", item, f"whose name is over {MAX_ITEM_CHARS:,} characters")
                continue
            if not self.usable("entity", _text(item["state"]), item):
                continue
            try:
                page = next(iter(self.pick(n, "page") for n in _numbers(item.get("page"))), None)
            except _Unknown:
                self.drop("entity", item)
                continue
            self.plan.pages.append(
                PageOp(_text(item["name"]), _text(item["state"]), _text(item.get("kind")), page)
            )
