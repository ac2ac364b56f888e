"""The search domain's values: a validated query, its scope and the candidates it ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.errors import InvalidArgument
from shared.layers import LAYERS_BY_NAME

DEFAULT_LIMIT = 5
MAX_LIMIT = 100
MIN_POOL = 30

VECTOR = "vector"
KEYWORD = "keyword"

# Which retrieval sources each reader name turns on.
READERS: dict[str, tuple[str, ...]] = {
    "": (VECTOR, KEYWORD),
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
    min_score: float
    """The cosine floor for vector hits; 0 disables it."""
    sources: tuple[str, ...]
    session_id: str = ""
    reference_time: float | None = None

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
        default_min_score: float,
        reader: str,
        session_id: str = "",
        reference_time: float | None = None,
    ) -> SearchQuery:
        """Checks and normalises a request; bad input is an InvalidArgument."""
        if not text.strip():
            raise InvalidArgument("query required")
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
        if not 0.0 <= floor <= 1.0:
            raise InvalidArgument(f"min_score {floor} is outside 0..1")
        if limit <= 0:
            limit = DEFAULT_LIMIT
        return cls(
            scope=scope,
            text=text,
            limit=min(limit, MAX_LIMIT),
            layers=tuple(dict.fromkeys(layers)),
            min_score=floor,
            sources=READERS[key],
            session_id=session_id,
            reference_time=reference_time,
        )


@dataclass(slots=True)
class Candidate:
    """One memory on its way through the pipeline, with what each source said about it."""

    memory_id: str
    layer: str
    content: str
    label: str = ""
    session_id: str = ""
    created_at: float = 0.0
    due_at: float | None = None
    cosine: float | None = None
    """Cosine similarity to the query, when the vector source saw the memory."""
    keyword_fraction: float | None = None
    """Share of the query's terms the memory contains, when the keyword source found it."""
    fused: float = 0.0
    """The fused rank score that orders candidates."""
    ranks: dict[str, int] = field(default_factory=dict)
    """1-based rank per source that ranked it."""
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
