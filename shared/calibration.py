"""Cosine thresholds calibrated per embedding model: one model's cosines run higher than
another's for the same pair of texts, so a threshold is chosen for the model that made the
vectors (its id), and an unknown model gets the reference's."""

from __future__ import annotations

# The similarity above which about nine in ten relevant passages score: a search's floor.
# BGE's cosines run high (the reference's 0.60); MiniLM's good matches sit around 0.3-0.6.
MODEL_FLOORS: dict[str, float] = {
    "bge-small-en-v1.5": 0.60,
    "all-MiniLM-L6-v2-int8": 0.30,
    "all-MiniLM-L6-v2": 0.30,
    "all-MiniLM-L6-v2-fp16": 0.30,
}
DEFAULT_FLOOR = 0.60

# The least similarity of a stored fact (or page) shown to extraction as related to a new
# turn, so the model can mark it replaced or updated: the reference's 0.70 for BGE. MiniLM
# gives a fact and a turn that changes it far less (20 such pairs, "Ana lives in Porto" and
# "I moved to Lisbon" 0.48, "I'm now in Berlin" 0.13: median 0.39, 16 of 20 at 0.25 or more,
# against 5% of pairs of a turn and an unrelated fact of the same person); each was nearer its
# turn than all ten unrelated facts, so the nearest few are shown from this low floor.
RELATED_SCORES: dict[str, float] = {
    "bge-small-en-v1.5": 0.70,
    "all-MiniLM-L6-v2-int8": 0.25,
    "all-MiniLM-L6-v2": 0.25,
    "all-MiniLM-L6-v2-fp16": 0.25,
}
DEFAULT_RELATED = 0.70


def calibrated_floor(model_id: str) -> float:
    """The vector floor for a model when HYATLAS_MIN_SCORE is unset (0.60 for unknown models)."""
    return MODEL_FLOORS.get(model_id, DEFAULT_FLOOR)


def related_score(model_id: str) -> float:
    """The least cosine of a row shown to extraction as related (0.70 for unknown models)."""
    return RELATED_SCORES.get(model_id, DEFAULT_RELATED)
