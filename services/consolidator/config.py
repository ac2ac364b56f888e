"""The consolidator service's settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared.settings import Settings


@dataclass(frozen=True)
class ConsolidatorConfig:
    """What the consolidator needs to run."""

    address: str
    """HYATLAS_CONSOLIDATOR_ADDR: the gRPC address to serve on."""
    store_address: str
    """HYATLAS_STORE_ADDR: the store's gRPC address."""
    embedder_address: str
    """HYATLAS_EMBEDDER_ADDR: the embedder's gRPC address (clusters and guards)."""
    mode: str = "ultra"
    """HYATLAS_MODE: only ultra runs passes."""
    llm_base: str = ""
    """HYATLAS_LLM_BASE: the primary OpenAI-compatible endpoint."""
    llm_model: str = ""
    """HYATLAS_LLM_MODEL: the primary model."""
    llm_key: str = ""
    """HYATLAS_LLM_KEY: the key used when the key file gives none."""
    llm_key_file: str = ""
    """HYATLAS_LLM_KEY_FILE: a plain-text key file, read on every call."""
    fallback_model: str = ""
    """HYATLAS_LLM_FALLBACK_MODEL: tried when the primary fails."""
    fallback_base: str = ""
    """HYATLAS_LLM_FALLBACK_BASE: the fallback's endpoint (empty: the primary's)."""
    fallback_key: str | None = None
    """HYATLAS_LLM_FALLBACK_KEY: None reuses the primary's key on the primary's host only."""
    max_tokens: int = 1024
    """HYATLAS_LLM_MAX_TOKENS: the most tokens one reply may take."""
    call_timeout_s: float = 300.0
    """HYATLAS_EXTRACT_TIMEOUT: how long one consolidation call may take."""
    every_s: float = 6 * 3600.0
    """HYATLAS_CONSOLIDATE_EVERY: interval between passes."""
    catchup_s: float | None = 20 * 60.0
    """HYATLAS_CONSOLIDATE_CATCHUP: interval while clusters are still due (None: every_s)."""
    batch: int = 50
    """HYATLAS_CONSOLIDATE_BATCH: most facts in one cluster (one call)."""
    parallel: int = 2
    """HYATLAS_CONSOLIDATE_PARALLEL: calls at once."""
    graph: bool = True
    """HYATLAS_CONSOLIDATE_GRAPH: whether passes write L5 edges and the arc."""
    recluster_s: float | None = None
    """HYATLAS_CONSOLIDATE_RECLUSTER: rebuild an owner's clusters after this long (None: never)."""
    cross_schema_every_s: float | None = 24 * 3600.0
    """HYATLAS_CROSS_SCHEMA_EVERY: least time between cross-topic passes of one owner."""
    raw_retention_s: float | None = None
    """HYATLAS_RAW_RETENTION: age after which uncited raw rows are deleted (None: never)."""
    user_aliases: tuple[tuple[str, ...], ...] = ()
    """HYATLAS_USER_ALIASES: ids of one person are consolidated together."""
    budget_s: float = 600.0
    """How long one pass may keep starting calls."""
    min_call_estimate_s: float = 180.0
    """The least time a call is expected to take when deciding whether to start one."""
    store_wait_s: float = 60.0
    """How long start-up waits for the store and embedder to serve."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ConsolidatorConfig:
        """Reads the HYATLAS_* settings the consolidator uses."""
        settings = Settings.from_env(os.environ if environ is None else environ)
        return cls(
            address=settings.address("consolidator"),
            store_address=settings.address("store"),
            embedder_address=settings.address("embedder"),
            mode=settings.mode,
            llm_base=settings.llm_base,
            llm_model=settings.llm_model,
            llm_key=settings.llm_key,
            llm_key_file=settings.llm_key_file,
            fallback_model=settings.llm_fallback_model,
            fallback_base=settings.llm_fallback_base,
            fallback_key=settings.llm_fallback_key,
            max_tokens=settings.llm_max_tokens,
            call_timeout_s=settings.extract_timeout_s,
            every_s=settings.consolidate_every_s or 6 * 3600.0,
            catchup_s=settings.consolidate_catchup_s,
            batch=settings.consolidate_batch,
            parallel=settings.consolidate_parallel,
            graph=settings.consolidate_graph,
            recluster_s=settings.consolidate_recluster_s,
            cross_schema_every_s=settings.cross_schema_every_s,
            raw_retention_s=settings.raw_retention_s,
            user_aliases=settings.user_aliases,
        )
