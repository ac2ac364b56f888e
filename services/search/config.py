"""SearchConfig: the search service's settings, read once at startup."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from services.search.model import RankingSettings
from services.search.switches import RETRIEVAL_SWITCHES, switchable_names
from shared.errors import ConfigError
from shared.settings import Settings


@dataclass(frozen=True)
class SearchConfig:
    """Where the search service listens, what it calls, and how it ranks."""

    address: str
    """HYATLAS_SEARCH_LISTEN or _ADDR: the one endpoint to serve on."""
    store_address: str
    """HYATLAS_STORE_ADDR: the store's gRPC address."""
    embedder_address: str
    """HYATLAS_EMBEDDER_ADDR: the embedder's gRPC address."""
    min_score: float | None = None
    """HYATLAS_MIN_SCORE: the default cosine floor for vector hits; 0 disables it; unset: the
    embedding model's calibrated floor (0.60 for BGE, 0.30 for MiniLM)."""
    intention_ttl_s: float | None = 168 * 3600.0
    """HYATLAS_INTENTION_TTL: how long an undated intention is shown; None: forever."""
    now_pages: bool = True
    """Whether to look for a Now page (only the LLM modes write one; lite does not)."""
    graph_recall: bool = True
    """Whether to ask the store for L5 edges (only the LLM modes write them; lite does not)."""
    disabled_stages: frozenset[str] = frozenset()
    """HYATLAS_SEARCH_DISABLE_STAGES: comma-separated ranking stages to switch off."""
    ranking: RankingSettings = RankingSettings()
    """HYATLAS_RECENCY, HYATLAS_MMR_LAMBDA and HYATLAS_USAGE_LEARNING."""
    grpc_token: str = ""
    """HYATLAS_GRPC_TOKEN: sent on calls out and required on a TCP listen address."""
    log_level: str = "INFO"
    """HYATLAS_LOG_LEVEL: DEBUG adds each search's per-stage timings to the log."""

    def pipeline_stages_off(self) -> frozenset[str]:
        """The disabled names that are ranking stages (the rest switch retrieval features)."""
        return self.disabled_stages - set(RETRIEVAL_SWITCHES)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SearchConfig:
        """Reads the settings; a bad stage name is a ConfigError naming the variable."""
        env = os.environ if environ is None else environ
        settings = Settings.from_env(env)
        raw = env.get("HYATLAS_SEARCH_DISABLE_STAGES", "")
        disabled = frozenset(part.strip() for part in raw.split(",") if part.strip())
        unknown = sorted(disabled - set(switchable_names()))
        if unknown:
            raise ConfigError(
                f"HYATLAS_SEARCH_DISABLE_STAGES={raw!r}: unknown search stage "
                f"{', '.join(unknown)}: expected one of {', '.join(switchable_names())}"
            )
        set_floor = bool(env.get("HYATLAS_MIN_SCORE", "").strip())
        return cls(
            address=settings.listen_address("search"),
            store_address=settings.address("store"),
            embedder_address=settings.address("embedder"),
            min_score=settings.min_score if set_floor else None,
            intention_ttl_s=settings.intention_ttl_s,
            now_pages=settings.uses_llm,
            graph_recall=settings.uses_llm,
            disabled_stages=disabled,
            ranking=RankingSettings(
                recency=settings.recency,
                mmr_lambda=settings.mmr_lambda,
                usage_learning=settings.usage_learning,
            ),
            grpc_token=settings.grpc_token,
            log_level=settings.log_level,
        )
