"""The status fields that describe the configuration in words."""

from __future__ import annotations

from gateway.config import GatewayConfig
from shared.layers import PENDING, SKIPPED


def mode_detail(config: GatewayConfig) -> str:
    """What the mode does, in words."""
    if config.mode == "lite":
        return "lite: raw writes and search only (L2); no LLM call at all"
    if config.mode == "pro":
        return (
            "pro: one LLM extraction per write (L1, L2, L3, L4, L7, L8) plus episode summaries; "
            "no consolidation"
        )
    detail = (
        "ultra: one LLM extraction per write plus the periodic consolidation pass "
        "(all eight layers; L5 and L6 come from consolidation)"
    )
    if not config.consolidate_graph:
        detail += "; HYATLAS_CONSOLIDATE_GRAPH=off: no L5 graph and no arc"
    return detail


def extract_sync(config: GatewayConfig) -> str:
    """The status `extract_sync` field."""
    if config.mode == "lite":
        return "none (lite mode)"
    if config.sync_extract:
        return "blocking (a write waits for its extraction; HYATLAS_SYNC_EXTRACT)"
    return "background (a write returns pending; extraction runs behind it; HYATLAS_SYNC_EXTRACT)"


def extraction_status(config: GatewayConfig) -> str:
    """The status a new raw row starts with; in pro and ultra the extractor then says more."""
    return SKIPPED if config.mode == "lite" else PENDING
