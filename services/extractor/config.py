"""The extractor service's settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared.aliases import Aliases
from shared.layers import EXTRACTION_TRIES
from shared.leases import lease_ttl_setting
from shared.settings import LlmSettings, Settings, read_duration


@dataclass(frozen=True)
class ExtractorConfig:
    """What the extractor needs to run."""

    address: str
    """HYATLAS_EXTRACTOR_LISTEN or _ADDR: the one endpoint to serve on."""
    store_address: str
    """HYATLAS_STORE_ADDR: the store's gRPC address."""
    embedder_address: str
    """HYATLAS_EMBEDDER_ADDR: the embedder's gRPC address (turn and fact vectors)."""
    mode: str = "ultra"
    """HYATLAS_MODE: lite never calls the LLM; pro and ultra extract every write."""
    llm: LlmSettings = LlmSettings()
    """HYATLAS_LLM_*: the extraction model, its key and fallback, timeout and reply cap."""
    reconcile: bool = False
    """HYATLAS_RECONCILE: a second call compares new facts with similar stored ones."""
    dedupe_score: float = 0.92
    """HYATLAS_DEDUPE_SCORE: a new fact this similar to a live one retires it as restated."""
    related_facts: int = 5
    """How many related facts the model is shown."""
    catchup_every_s: float | None = 600.0
    """HYATLAS_CATCHUP_EVERY: how often unextracted raw rows are caught up; None: never."""
    catchup_max_age_s: float | None = 168 * 3600.0
    """HYATLAS_CATCHUP_MAX_AGE: the oldest raw row catch-up takes; None: no limit."""
    catchup_min_age_s: float = 120.0
    """HYATLAS_CATCHUP_MIN_AGE: rows younger than this are left to the write that made them."""
    catchup_batch: int = 20
    """Most rows one catch-up run extracts."""
    catchup_tries: int = EXTRACTION_TRIES
    """After this many unparseable replies a row is left alone."""
    now_every_s: float | None = 15 * 60.0
    """HYATLAS_NOW_EVERY: least time between Now page rebuilds; None: after every write."""
    episode_gap_s: float | None = 30 * 60.0
    """HYATLAS_EPISODE_GAP: a pause that ends an episode of work; None: no episode summaries."""
    intention_ttl_s: float | None = 168 * 3600.0
    """HYATLAS_INTENTION_TTL: how long an undated intention is current (the Now page shows it
    as open); None: forever."""
    user_aliases: Aliases = Aliases()
    """HYATLAS_USER_ALIASES: Now pages and episodes are kept under a group's first id."""
    lease_ttl_s: float = 60.0
    """HYATLAS_LEASE_TTL: how long an owner's extraction lease (one replica extracts an owner
    at a time) lasts unrenewed; a replica killed mid-extraction frees the owner after this."""
    lease_poll_s: float = 0.5
    """How often an extraction waiting for its owner's lease asks again."""
    stop_grace_s: float = 10.0
    """How long a clean stop waits for extractions in flight."""
    warn_every_s: float = 10.0
    """How long start-up waits for the store and the embedder to serve before it warns that it
    still waits, and then between such warnings (it waits as long as it takes)."""
    grpc_token: str = ""
    """HYATLAS_GRPC_TOKEN: sent on calls out and required on a TCP listen address."""
    log_level: str = "INFO"
    """HYATLAS_LOG_LEVEL: the process's log level."""

    @property
    def uses_llm(self) -> bool:
        """Whether the mode extracts at all."""
        return self.mode != "lite"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ExtractorConfig:
        """Reads the HYATLAS_* settings the extractor uses."""
        env = os.environ if environ is None else environ
        settings = Settings.from_env(env)
        min_age = read_duration(env, "HYATLAS_CATCHUP_MIN_AGE", 120.0)
        return cls(
            address=settings.listen_address("extractor"),
            store_address=settings.address("store"),
            embedder_address=settings.address("embedder"),
            mode=settings.mode,
            llm=settings.llm,
            reconcile=settings.reconcile,
            dedupe_score=settings.dedupe_score,
            catchup_every_s=settings.catchup_every_s,
            catchup_max_age_s=settings.catchup_max_age_s,
            catchup_min_age_s=min_age or 0.0,
            now_every_s=settings.now_every_s,
            episode_gap_s=settings.episode_gap_s,
            intention_ttl_s=settings.intention_ttl_s,
            user_aliases=settings.user_aliases,
            lease_ttl_s=lease_ttl_setting(env),
            grpc_token=settings.grpc_token,
            log_level=settings.log_level,
        )
