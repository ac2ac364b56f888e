"""Cosine thresholds calibrated per embedding model: one model's cosines run higher than
another's for the same pair of texts, so a threshold is chosen for the model that made the
vectors (its id), and an unknown model gets the reference's."""

from __future__ import annotations

from typing import NamedTuple


class Calibration(NamedTuple):
    """One model's thresholds."""

    floor: float
    """The similarity above which about nine in ten relevant passages score: a search's floor.
    BGE's cosines run high (the reference's 0.60); MiniLM's good matches sit around 0.3-0.6."""
    related: float
    """The least similarity of a stored fact (or page) shown to extraction as related to a new
    turn, so the model can mark it replaced or updated: the reference's 0.70 for BGE. MiniLM
    gives a fact and a turn that changes it far less (20 such pairs, "Ana lives in Porto" and
    "I moved to Lisbon" 0.48, "I'm now in Berlin" 0.13: median 0.39, 16 of 20 at 0.25 or more,
    against 5% of pairs of a turn and an unrelated fact of the same person); each was nearer
    its turn than all ten unrelated facts, so the nearest few are shown from this low floor."""
    similar: float
    """The least similarity of a stored fact the second extraction call (HYATLAS_RECONCILE)
    compares with a new fact: the reference's 0.70 for BGE. Between facts MiniLM runs higher
    than between a turn and a fact: 19 pairs of a fact and the fact that changes it ("Ana
    lives in Porto", "Ana lives in Lisbon") gave 0.609-0.791, median 0.733 (10 of 19 at 0.70
    or more), against a median of 0.446 and 5% over 0.578 for pairs of unrelated facts of one
    person."""


REFERENCE = Calibration(floor=0.60, related=0.70, similar=0.70)
"""The reference's thresholds (for BGE), also those of a model not listed."""
MINILM = Calibration(floor=0.30, related=0.25, similar=0.60)
CALIBRATIONS: dict[str, Calibration] = {
    "bge-small-en-v1.5": REFERENCE,
    "all-MiniLM-L6-v2-int8": MINILM,
    "all-MiniLM-L6-v2": MINILM,
    "all-MiniLM-L6-v2-fp16": MINILM,
}


def calibrated_floor(model_id: str) -> float:
    """The vector floor for a model when HYATLAS_MIN_SCORE is unset (0.60 for unknown models)."""
    return CALIBRATIONS.get(model_id, REFERENCE).floor


def related_score(model_id: str) -> float:
    """The least cosine of a row shown to extraction as related (0.70 for unknown models)."""
    return CALIBRATIONS.get(model_id, REFERENCE).related


def similar_score(model_id: str) -> float:
    """The least cosine of a stored fact a new one is compared with (0.70 for unknown models)."""
    return CALIBRATIONS.get(model_id, REFERENCE).similar
