"""Layer names as the REST API spells them, their proto enum values, and the labels and
extraction states rules use."""

from __future__ import annotations

from shared.errors import InvalidArgument
from shared.pb import common_pb2

LAYER_NAMES: dict[int, str] = {
    common_pb2.L1_PROFILE: "l1_profile",
    common_pb2.L2_RAW: "l2_raw",
    common_pb2.L3_FACT: "l3_fact",
    common_pb2.L4_SUMMARY: "l4_summary",
    common_pb2.L5_KNOWLEDGE: "l5_knowledge",
    common_pb2.L6_SCHEMA: "l6_schema",
    common_pb2.L7_INTENTION: "l7_intention",
    common_pb2.L8_ENTITY: "l8_entity",
}
LAYERS_BY_NAME: dict[str, int] = {name: value for value, name in LAYER_NAMES.items()}
# Fact labels that rules act on: the profile mirrors preferences; experiences are never restated.
PREFERENCES = "user_preferences"
EXPERIENCE = "task_experience"
NOW_PAGE = "now_page"
"""The label of an owner's Now page (an L4 summary): one is live at a time."""
ARC = "arc"
"""The label of an owner's arc (an L4 summary the consolidator keeps): one is live at a time."""
ONE_LIVE = {NOW_PAGE: "Now page", ARC: "arc"}
"""Labels (and names) of summaries an owner has one live row of: a newer stands for the older."""
REPLACED = "replaced"
"""How a row is retired by a newer version of it whose value changed (an edit, or a fact
extraction replaced): a search shows it under that version's `replaced`."""
PENDING, DONE, FAILED = "pending", "done", "failed"
SKIPPED, UNCONFIGURED = "skipped", "unconfigured"
EXTRACTION_STATES = (PENDING, DONE, FAILED, SKIPPED, UNCONFIGURED)
"""What a raw turn's extraction_status may say (other rows say nothing: "")."""
UNEXTRACTED = frozenset({PENDING, FAILED, UNCONFIGURED})
"""Extraction states of a raw turn still to be extracted (or being extracted now)."""
EXTRACTION_TRIES = 3
"""Failed tries after which a raw turn's extraction is given up: catch-up passes it over and
status no longer counts it unextracted (reprocess still takes it)."""
_SHORT = {f"l{value}": value for value in LAYER_NAMES}
_WORDS = {name.split("_", 1)[1]: value for value, name in LAYER_NAMES.items()}


def layer_name(value: int) -> str:
    """The REST name of a proto layer value ("l2_raw")."""
    return LAYER_NAMES[value]


def parse_layer(text: str) -> int:
    """Reads a layer as "l2_raw", "L2", "2" or "raw"; anything else is an InvalidArgument."""
    key = text.strip().lower()
    if key in LAYERS_BY_NAME:
        return LAYERS_BY_NAME[key]
    if key in _SHORT:
        return _SHORT[key]
    if key.isdigit() and f"l{key}" in _SHORT:
        return _SHORT[f"l{key}"]
    if key in _WORDS:
        return _WORDS[key]
    names = ", ".join(LAYERS_BY_NAME)
    raise InvalidArgument(f"unknown layer {text!r}: expected one of {names}")
