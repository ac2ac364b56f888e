"""Reading a consolidation reply: its shape checked whole, each op against what was shown."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.dates import parse_date
from shared.errors import ServiceError
from shared.llm import shown_number

TEXT_CHARS = 2000
NAME_CHARS = 200


class PartialReply(ServiceError):
    """The reply lacks a key or has one of the wrong type: nothing of it is applied."""


@dataclass(frozen=True)
class Merge:
    """Facts (0-based) that one statement replaces."""

    facts: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Drop:
    """A fact (0-based) retired with a reason."""

    fact: int
    reason: str


@dataclass(frozen=True)
class Schema:
    """A pattern and the facts (0-based) that show it."""

    text: str
    facts: tuple[int, ...]


@dataclass(frozen=True)
class EdgeOp:
    """A relation and the facts (0-based) behind it."""

    subject: str
    relation: str
    object: str
    facts: tuple[int, ...]
    valid_from: float | None = None


@dataclass(frozen=True)
class EndEdge:
    """An existing edge (0-based) that stopped being true."""

    edge: int
    valid_to: float | None = None


@dataclass
class Plan:
    """The ops of one reply that survived the checks, and why the others did not."""

    merges: list[Merge] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)
    schemas: list[Schema] = field(default_factory=list)
    edges: list[EdgeOp] = field(default_factory=list)
    end_edges: list[EndEdge] = field(default_factory=list)
    arc: str = ""
    refused: list[str] = field(default_factory=list)


def _edge_number(value: Any) -> int | None:
    if isinstance(value, str) and value.strip().strip("[]").upper().startswith("E"):
        return shown_number(value.strip().strip("[]")[1:])
    return shown_number(value)


def _text(value: Any, limit: int) -> str:
    return " ".join(value.split())[:limit] if isinstance(value, str) else ""


def read_plan(
    reply: dict[str, Any],
    keys: Sequence[str],
    sources: Sequence[Sequence[str]],
    edges_from: Sequence[float | None],
) -> Plan:
    """Checks a reply against the facts shown (sources[i]: the turns behind fact i+1) and the
    edges shown (edges_from[i]: when edge i+1 began, if known).

    A missing key or a key of the wrong type is a PartialReply; an op naming a number that was
    not shown, reusing a fact, lacking what it needs or ending an edge before it began is
    refused and listed.
    """
    for key in keys:
        if key not in reply:
            raise PartialReply(f"the reply lacks {key!r}")
        wanted = str if key == "arc" else list
        if not isinstance(reply[key], wanted):
            raise PartialReply(f"{key!r} is not a {wanted.__name__}")
    reader = _PlanReader(sources, edges_from)
    reader.merges(reply.get("merges", []))
    reader.drops(reply.get("drops", []))
    reader.schemas(reply.get("schemas", []))
    reader.edges(reply.get("edges", []))
    reader.end_edges(reply.get("end_edges", []))
    reader.plan.arc = _text(reply.get("arc"), TEXT_CHARS)
    return reader.plan


class _PlanReader:
    """Checks each op of one reply; a fact serves one merge or drop at most."""

    def __init__(
        self, sources: Sequence[Sequence[str]], edges_from: Sequence[float | None]
    ) -> None:
        self.plan = Plan()
        self.sources = sources
        self.edges_from = edges_from
        self.used: set[int] = set()

    def refuse(self, why: str) -> None:
        self.plan.refused.append(why)

    def facts_of(self, item: dict[str, Any], what: str, least: int) -> tuple[int, ...] | None:
        raw = item.get("facts")
        if not isinstance(raw, list):
            self.refuse(f"{what}: no facts listed")
            return None
        numbers = [shown_number(v) for v in raw]
        if any(n is None or not 1 <= n <= len(self.sources) for n in numbers):
            self.refuse(f"{what}: names a fact number that was not shown: {raw!r:.80}")
            return None
        picked = tuple(dict.fromkeys(n - 1 for n in numbers if n is not None))
        if len(picked) < least:
            self.refuse(f"{what}: needs at least {least} facts")
            return None
        return picked

    def merges(self, items: list[Any]) -> None:
        for item in items:
            if not isinstance(item, dict):
                self.refuse("merge: not an object")
            elif (facts := self.facts_of(item, "merge", 2)) is None:
                continue
            elif self.used & set(facts):
                self.refuse("merge: a fact is already used by another op")
            else:
                self.used |= set(facts)
                self.plan.merges.append(Merge(facts, _text(item.get("text"), TEXT_CHARS)))

    def drops(self, items: list[Any]) -> None:
        for item in items:
            n = shown_number(item.get("fact")) if isinstance(item, dict) else None
            reason = _text(item.get("reason"), TEXT_CHARS) if isinstance(item, dict) else ""
            if n is None or not 1 <= n <= len(self.sources):
                self.refuse(f"drop: names a fact number that was not shown: {item!r:.80}")
            elif not reason:
                self.refuse("drop: no reason given")
            elif n - 1 in self.used:
                self.refuse("drop: the fact is already used by another op")
            else:
                self.used.add(n - 1)
                self.plan.drops.append(Drop(n - 1, reason))

    def _dropped(self) -> set[int]:
        return {d.fact for d in self.plan.drops}

    def schemas(self, items: list[Any]) -> None:
        for item in items:
            if not isinstance(item, dict) or not _text(item.get("text"), TEXT_CHARS):
                self.refuse("schema: no text")
            elif (facts := self.facts_of(item, "schema", 2)) is None:
                continue
            elif self._dropped() & set(facts):
                self.refuse("schema: rests on a fact this pass drops")
            else:
                self.plan.schemas.append(Schema(_text(item["text"], TEXT_CHARS), facts))

    def edges(self, items: list[Any]) -> None:
        for item in items:
            if not isinstance(item, dict):
                self.refuse("edge: not an object")
                continue
            names = [_text(item.get(k), NAME_CHARS) for k in ("subject", "relation", "object")]
            if not all(names):
                self.refuse("edge: needs subject, relation and object")
            elif (facts := self.facts_of(item, "edge", 1)) is None:
                continue
            elif self._dropped() & set(facts):
                self.refuse("edge: rests on a fact this pass drops")
            elif len({turn for i in facts for turn in self.sources[i]}) < 2:
                self.refuse(f"edge {names[0]} {names[1]} {names[2]}: corroborated by one turn only")
            else:
                self.plan.edges.append(EdgeOp(
                    names[0], names[1], names[2], facts, parse_date(item.get("valid_from"))))

    def end_edges(self, items: list[Any]) -> None:
        for item in items:
            n = _edge_number(item.get("edge")) if isinstance(item, dict) else None
            if n is None or not 1 <= n <= len(self.edges_from):
                self.refuse(f"end_edge: names an edge that was not shown: {item!r:.80}")
                continue
            began, ends = self.edges_from[n - 1], parse_date(item.get("valid_to"))
            if began is not None and ends is not None and ends < began:
                self.refuse(f"end_edge E{n}: ends before it began: {item!r:.80}")
            else:
                self.plan.end_edges.append(EndEdge(n - 1, ends))


Pattern = tuple[str, tuple[int, ...]]


def read_patterns(reply: dict[str, Any], shown: int) -> tuple[list[Pattern], list[str]]:
    """The cross-topic patterns (text, 0-based schemas) of a reply, and the refused ones."""
    patterns = reply.get("patterns")
    if not isinstance(patterns, list):
        raise PartialReply("the reply lacks a 'patterns' list")
    kept: list[Pattern] = []
    refused: list[str] = []
    for item in patterns[:3]:
        text = _text(item.get("text"), TEXT_CHARS) if isinstance(item, dict) else ""
        raw = item.get("schemas") if isinstance(item, dict) else None
        numbers = [shown_number(v) for v in raw] if isinstance(raw, list) else []
        if not text or not numbers or any(n is None or not 1 <= n <= shown for n in numbers):
            refused.append(f"cross pattern: names a pattern that was not shown: {item!r:.80}")
            continue
        picked = tuple(dict.fromkeys(n - 1 for n in numbers if n is not None))
        if len(picked) < 2:
            refused.append("cross pattern: needs two or more patterns")
            continue
        kept.append((text, picked))
    return kept, refused
