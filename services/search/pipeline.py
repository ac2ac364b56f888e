"""The ranking pipeline as data: named stages run in order, any of them switchable off."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from services.search import ranking, stages
from services.search.graph import GRAPH, join_graph
from services.search.model import Candidate, SearchContext

StageFn = Callable[[list[Candidate], SearchContext], list[Candidate]]


@dataclass(frozen=True, slots=True)
class Stage:
    """One named step of the ranking."""

    name: str
    run: StageFn


@dataclass(frozen=True, slots=True)
class StageTiming:
    """How long one stage took and how many candidates it left."""

    name: str
    ms: float
    count: int


@dataclass(frozen=True)
class Pipeline:
    """An ordered list of stages; the first builds the ranking from the context's hits."""

    stages: tuple[Stage, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The stage names in order."""
        return tuple(stage.name for stage in self.stages)

    def without(self, names: Collection[str]) -> Pipeline:
        """The same pipeline minus the named stages; an unknown name is a ValueError."""
        unknown = sorted(set(names) - set(self.names))
        if unknown:
            known = ", ".join(self.names)
            raise ValueError(f"unknown search stage {', '.join(unknown)}: expected one of {known}")
        return Pipeline(tuple(stage for stage in self.stages if stage.name not in names))

    def run(self, ctx: SearchContext) -> tuple[list[Candidate], list[StageTiming]]:
        """Runs every stage in order; returns the final ranking and each stage's timing."""
        ranked: list[Candidate] = []
        timings = []
        skip = ctx.query.skip_stages
        for stage in self.stages:
            if stage.name in skip:
                continue
            started = time.perf_counter()
            ranked = stage.run(ranked, ctx)
            timings.append(
                StageTiming(stage.name, (time.perf_counter() - started) * 1000.0, len(ranked))
            )
        return ranked, timings


PLAIN_PIPELINE = Pipeline(
    (
        Stage("fuse", stages.fuse),
        Stage("ended", stages.drop_ended),
        Stage("intention_ttl", stages.drop_stale_intentions),
        Stage("now_apart", stages.drop_now_pages),
        Stage("dedupe", stages.drop_repeated_text),
        Stage("l5_cap", stages.cap_knowledge),
        Stage("session_intentions", stages.own_session_intentions_first),
        Stage("truncate", stages.truncate),
    )
)
"""The plain hybrid: reciprocal-rank fusion and the reference's post-processing (reader rrf)."""

LITE_PIPELINE = Pipeline(
    (
        Stage("fuse", ranking.fuse_scores),
        Stage(GRAPH, join_graph),
        Stage("dates", ranking.boost_dates),
        Stage("times", ranking.favour_times),
        Stage("entities", ranking.boost_entities),
        Stage("speaker", ranking.favour_the_speaker),
        Stage("first_person", ranking.favour_the_owner),
        Stage("recency", ranking.boost_recency),
        Stage("usage", ranking.boost_usage),
        Stage("ended", stages.drop_ended),
        Stage("intention_ttl", stages.drop_stale_intentions),
        Stage("now_apart", stages.drop_now_pages),
        Stage("dedupe", stages.drop_repeated_text),
        Stage("near_duplicates", ranking.demote_near_duplicates),
        Stage("sittings", ranking.favour_sittings),
        Stage("replies", ranking.lift_replies),
        Stage("mmr", ranking.mmr),
        Stage("l5_cap", stages.cap_knowledge),
        Stage("session_intentions", stages.own_session_intentions_first),
        Stage("truncate", stages.truncate),
    )
)
"""The full ranking: weighted score fusion, the boosts, demotion and diversity, then the
reference's post-processing and the limit."""

# Retrieval features that are switched off like stages but act before the ranking runs.
CONTEXT_KEYS = "context_keys"
RELAXED_KEYWORDS = "relaxed_keywords"
RETRIEVAL_SWITCHES = (CONTEXT_KEYS, RELAXED_KEYWORDS)


# Fusion makes the ranking; without it there is nothing for the other stages to order.
ALWAYS_ON = frozenset({"fuse"})


def switchable_names() -> tuple[str, ...]:
    """Every name HYATLAS_SEARCH_DISABLE_STAGES and a request's skip_stages accept."""
    return (*(n for n in LITE_PIPELINE.names if n not in ALWAYS_ON), *RETRIEVAL_SWITCHES)
