"""SearchConfig: the search service's settings, read once at startup."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from services.search.pipeline import LITE_PIPELINE
from shared.errors import ConfigError
from shared.settings import Settings


@dataclass(frozen=True)
class SearchConfig:
    """Where the search service listens, what it calls, and how it ranks."""

    address: str
    """HYATLAS_SEARCH_ADDR: the gRPC address to serve on."""
    store_address: str
    """HYATLAS_STORE_ADDR: the store's gRPC address."""
    embedder_address: str
    """HYATLAS_EMBEDDER_ADDR: the embedder's gRPC address."""
    min_score: float = 0.60
    """HYATLAS_MIN_SCORE: the default cosine floor for vector hits; 0 disables it."""
    intention_ttl_s: float | None = 168 * 3600.0
    """HYATLAS_INTENTION_TTL: how long an undated intention is shown; None: forever."""
    now_pages: bool = True
    """Whether to look for a Now page (only the LLM modes write one; lite does not)."""
    disabled_stages: frozenset[str] = frozenset()
    """HYATLAS_SEARCH_DISABLE_STAGES: comma-separated ranking stages to switch off."""
    log_level: str = "INFO"
    """HYATLAS_LOG_LEVEL: DEBUG adds each search's per-stage timings to the log."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SearchConfig:
        """Reads the settings; a bad stage name is a ConfigError naming the variable."""
        env = os.environ if environ is None else environ
        settings = Settings.from_env(env)
        raw = env.get("HYATLAS_SEARCH_DISABLE_STAGES", "")
        disabled = frozenset(part.strip() for part in raw.split(",") if part.strip())
        try:
            LITE_PIPELINE.without(disabled)
        except ValueError as exc:
            raise ConfigError(f"HYATLAS_SEARCH_DISABLE_STAGES={raw!r}: {exc}") from None
        return cls(
            address=settings.address("search"),
            store_address=settings.address("store"),
            embedder_address=settings.address("embedder"),
            min_score=settings.min_score,
            intention_ttl_s=settings.intention_ttl_s,
            now_pages=settings.uses_llm,
            disabled_stages=disabled,
            log_level=settings.log_level,
        )
