"""Reciprocal-rank fusion of the retrieval sources' rankings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.search.model import KEYWORD, VECTOR, Candidate

RRF_K = 60


def reciprocal_rank_fusion(
    rankings: Mapping[str, Sequence[Candidate]], k: int = RRF_K
) -> list[Candidate]:
    """Merges best-first rankings by id: each ranking adds 1/(k + rank) to a memory's fused score.

    Ties go to the higher cosine, then to the memory seen first. Candidates are updated in place;
    the first ranking's copy of a memory is the one kept, with the others' findings merged in.
    """
    merged: dict[str, Candidate] = {}
    for source, ranking in rankings.items():
        for rank, candidate in enumerate(ranking, start=1):
            kept = merged.get(candidate.memory_id)
            if kept is None:
                kept = merged[candidate.memory_id] = candidate
                kept.fused = 0.0
            else:
                if kept.cosine is None:
                    kept.cosine = candidate.cosine
                if kept.keyword_fraction is None:
                    kept.keyword_fraction = candidate.keyword_fraction
            kept.ranks[source] = rank
            kept.fused += 1.0 / (k + rank)
    return sorted(
        merged.values(),
        key=lambda c: (-c.fused, -(c.cosine if c.cosine is not None else -1.0)),
    )


def fuse_sources(
    vector: Sequence[Candidate],
    keyword: Sequence[Candidate],
    *,
    min_score: float,
    k: int = RRF_K,
) -> list[Candidate]:
    """Fuses vector and keyword hits; the cosine floor ranks vector hits only.

    The vector list may hold hits under the floor: they take no vector rank, but a keyword hit
    for the same memory still reports its real cosine. Keyword hits are never floored, because
    what they are for (identifiers, numbers, names) is what an embedding scores low.
    """
    cosines = {c.memory_id: c.cosine for c in vector if c.cosine is not None}
    for candidate in keyword:
        if candidate.cosine is None:
            candidate.cosine = cosines.get(candidate.memory_id)
    ranked_vector = [
        c for c in vector if c.cosine is not None and (min_score <= 0 or c.cosine >= min_score)
    ]
    return reciprocal_rank_fusion({VECTOR: ranked_vector, KEYWORD: keyword}, k)
