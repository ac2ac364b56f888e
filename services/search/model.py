"""The search domain's values: a validated query, its scope and the candidates it ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.errors import InvalidArgument
from shared.layers import LAYERS_BY_NAME
from shared.limits import (
    END_OF_CALENDAR_S,
    FIRST_TIME_S,
    check_text,
    check_utc_offset,
)

DEFAULT_LIMIT = 5
MAX_LIMIT = 100
MIN_POOL = 30

VECTOR = "vector"
KEYWORD = "keyword"

# The plain reciprocal-rank hybrid, kept as the baseline the full ranking is measured against.
PLAIN_READER = "rrf"

# Which retrieval sources each reader name turns on.
READERS: dict[str, tuple[str, ...]] = {
    "": (VECTOR, KEYWORD),
    PLAIN_READER: (VECTOR, KEYWORD),
    "hybrid": (VECTOR, KEYWORD),
    "hybrid_tag": (VECTOR, KEYWORD),
    "legacy": (VECTOR,),
    "semantic": (VECTOR,),
    "vector": (VECTOR,),
    "keyword": (KEYWORD,),
}


@dataclass(frozen=True, slots=True)
class Scope:
    """The owner a search may reach; the store expands user_id to its alias group."""

    user_id: str
    agent_id: str = ""


@dataclass(frozen=True, slots=True)
class SearchQuery:
    """A validated search request."""

    scope: Scope
    text: str
    limit: int
    layers: tuple[str, ...]
    """Layer names asked for; empty means every layer."""
    min_score: float | None
    """The cosine floor for vector hits; 0 disables it; None: the embedding model's own."""
    sources: tuple[str, ...]
    session_id: str = ""
    reference_time: float | None = None
    reference_utc_offset_minutes: int = 0
    """The asker's UTC offset: the days the query's dates name start at their midnight."""
    plain: bool = False
    """The plain rank-fusion baseline: strict keywords, no extra keys, no boosts."""
    skip_stages: frozenset[str] = frozenset()
    """Stages this request switches off (a debugging and benchmarking option)."""

    @property
    def pool(self) -> int:
        """How many candidates each retrieval source is asked for."""
        return max(self.limit * 3, MIN_POOL)

    @classmethod
    def build(
        cls,
        *,
        scope: Scope,
        text: str,
        limit: int,
        layers: Sequence[str],
        min_score: float | None,
        default_min_score: float | None,
        reader: str,
        session_id: str = "",
        reference_time: float | None = None,
        reference_utc_offset_minutes: int = 0,
        skip_stages: Sequence[str] = (),
    ) -> SearchQuery:
        """Checks and normalises a request; bad input is an InvalidArgument."""
        if not text.strip():
            raise InvalidArgument("query required")
        check_text("query", text)
        if not scope.user_id:
            raise InvalidArgument("scope.user_id required")
        key = reader.strip().lower()
        if key not in READERS:
            names = ", ".join(name for name in READERS if name)
            raise InvalidArgument(f"unknown reader {reader!r}: expected one of {names}")
        for layer in layers:
            if layer not in LAYERS_BY_NAME:
                raise InvalidArgument(f"unknown layer {layer!r}")
        floor = default_min_score if min_score is None else min_score
        if floor is not None and not 0.0 <= floor <= 1.0:
            raise InvalidArgument(f"min_score {floor} is outside 0..1")
        if limit < 0:
            raise InvalidArgument("limit must not be negative")
        limit = limit or DEFAULT_LIMIT
        if limit > MAX_LIMIT:
            raise InvalidArgument(f"limit {limit} is over the maximum of {MAX_LIMIT}")
        if reference_time is not None and not FIRST_TIME_S <= reference_time < END_OF_CALENDAR_S:
            raise InvalidArgument(
                f"reference_time {reference_time} is not between 1970 and the year 9999"
            )
        _check_utc_offset(reference_time, reference_utc_offset_minutes)
        return cls(
            scope=scope,
            text=text,
            limit=limit,
            layers=tuple(dict.fromkeys(layers)),
            min_score=floor,
            sources=READERS[key],
            session_id=session_id,
            reference_time=reference_time,
            reference_utc_offset_minutes=reference_utc_offset_minutes,
            plain=key == PLAIN_READER,
            skip_stages=frozenset(name.strip() for name in skip_stages if name.strip()),
        )


def _check_utc_offset(reference_time: float | None, minutes: int) -> None:
    """Refuses an offset of a day or more, or one that moves the reference day off the calendar."""
    check_utc_offset("reference_utc_offset_minutes", minutes)
    if reference_time is not None and reference_time + minutes * 60 >= END_OF_CALENDAR_S:
        raise InvalidArgument(
            f"reference_time {reference_time} at UTC offset {minutes} minutes is in the year 10000"
        )


@dataclass(slots=True)
class Candidate:
    """One memory on its way through the pipeline, with what each source said about it."""

    memory_id: str
    layer: str
    content: str
    label: str = ""
    session_id: str = ""
    follows_id: str = ""
    """For a conversation turn: the turn before it in its sitting (which it may answer)."""
    created_at: float = 0.0
    due_at: float | None = None
    event_at: float | None = None
    utc_offset_minutes: int = 0
    """The writer's UTC offset: the clock its dates alone (a due date) are read on."""
    valid_to: float | None = None
    """When it stopped being true in the world, if it did (an L5 relation whose edge ended)."""
    source_ids: tuple[str, ...] = ()
    """The rows it was derived from (for an L6 schema: its evidence facts)."""
    hits: int = 0
    """How many times a reply used the memory (usage feedback)."""
    cosine: float | None = None
    """Cosine similarity to the query, when the vector source saw the memory."""
    keyword_fraction: float | None = None
    """Share of the query's terms the memory contains, when the keyword source found it."""
    keyword_score: float | None = None
    """The keyword score of the memory's own text (higher is better), when the keyword
    source found it: bm25 for a strict hit, the idf of the terms held for a relaxed one."""
    strict: bool = False
    """Whether it holds enough of the query's terms for the strict keyword rule."""
    context_score: float | None = None
    """The keyword score of its context key (the turn with its neighbours), when that
    matched."""
    fused: float = 0.0
    """The fused rank score that orders candidates."""
    words: frozenset[str] | None = None
    """Its first distinct lowercase words (ranking.tokens), once a pairwise stage needed them."""
    ranks: dict[str, int] = field(default_factory=dict)
    """1-based rank per source that ranked it."""
    graph: bool = False
    """Whether only graph-assisted recall found it (an evidence fact or edge memory)."""
    evidence: list[Candidate] = field(default_factory=list)
    """For an L6 schema in the results: the live facts it was drawn from."""
    payload: Any = None
    """What the store returned for it, handed back to the caller untouched."""

    @property
    def score(self) -> float:
        """The score reported to callers: the cosine when known, else the keyword term share."""
        if self.cosine is not None:
            return self.cosine
        if self.keyword_fraction is not None:
            return self.keyword_fraction
        return 0.0


@dataclass(slots=True)
class SearchContext:
    """What the ranking stages read besides the ranked list: the query and the raw hits."""

    query: SearchQuery
    vector: list[Candidate]
    """Vector hits, best first, including those under the floor."""
    keyword: list[Candidate]
    """Keyword hits, best first."""
    now: float
    """Wall-clock unix seconds, for the intention rules."""
    intention_ttl_s: float | None
    """How long an intention without a due date is shown; None: forever."""
    context: list[Candidate] = field(default_factory=list)
    """Memories found by their context keys, best first."""
    settings: RankingSettings = field(default_factory=lambda: RankingSettings())
    """How the ranking stages are tuned."""
    model_floor: float = 0.60
    """The embedding model's calibrated floor, for when neither request nor setting sets one."""
    graph: list[Candidate] = field(default_factory=list)
    """Memories behind the L5 edges of entities the query names (graph-assisted recall)."""
    overlaps: tuple[dict[str, int], Any] | None = None
    """The last pairwise pass's word overlaps: each memory's row, and the matrix
    (ranking.head_overlaps)."""

    @property
    def floor(self) -> float:
        """The cosine floor in force: the request's, else the setting's, else the model's."""
        return self.query.min_score if self.query.min_score is not None else self.model_floor

    @property
    def reference_time(self) -> float:
        """The moment relative dates in the query are read against."""
        q = self.query.reference_time
        return q if q is not None else self.now


@dataclass(frozen=True, slots=True)
class RankingSettings:
    """The ranking's settings (HYATLAS_RECENCY, HYATLAS_MMR_LAMBDA, HYATLAS_USAGE_LEARNING)."""

    recency: bool = True
    mmr_lambda: float = 0.75
    usage_learning: bool = True


