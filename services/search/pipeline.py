"""The ranking pipeline as data: named stages run in order, any of them switchable off."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from services.search import ranking, stages
from services.search.graph import join_graph
from services.search.model import Candidate, SearchContext
from services.search.switches import FULL_RANKING, GRAPH

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

FULL_RANKING_RUNS: dict[str, StageFn] = {
    "fuse": ranking.fuse_scores,
    GRAPH: join_graph,
    "dates": ranking.boost_dates,
    "times": ranking.favour_times,
    "entities": ranking.boost_entities,
    "speaker": ranking.favour_the_speaker,
    "first_person": ranking.favour_the_owner,
    "recency": ranking.boost_recency,
    "usage": ranking.boost_usage,
    "ended": stages.drop_ended,
    "intention_ttl": stages.drop_stale_intentions,
    "now_apart": stages.drop_now_pages,
    "dedupe": stages.drop_repeated_text,
    "near_duplicates": ranking.demote_near_duplicates,
    "sittings": ranking.favour_sittings,
    "replies": ranking.lift_replies,
    "mmr": ranking.mmr,
    "replaced_turns": ranking.follow_their_facts,
    "l5_cap": stages.cap_knowledge,
    "session_intentions": stages.own_session_intentions_first,
    "truncate": stages.truncate,
}
"""What each stage of the full ranking does (switches.FULL_RANKING names them in order)."""

LITE_PIPELINE = Pipeline(tuple(Stage(name, FULL_RANKING_RUNS[name]) for name in FULL_RANKING))
"""The full ranking: weighted score fusion, the boosts, demotion and diversity, then the
reference's post-processing and the limit."""
