"""The consolidator service's settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared.aliases import Aliases
from shared.leases import lease_ttl_setting
from shared.settings import LlmSettings, Settings


@dataclass(frozen=True)
class ConsolidatorConfig:
    """What the consolidator needs to run."""

    address: str
    """HYATLAS_CONSOLIDATOR_LISTEN or _ADDR: the one endpoint to serve on."""
    store_address: str
    """HYATLAS_STORE_ADDR: the store's gRPC address."""
    embedder_address: str
    """HYATLAS_EMBEDDER_ADDR: the embedder's gRPC address (clusters and guards)."""
    mode: str = "ultra"
    """HYATLAS_MODE: only ultra runs passes."""
    llm: LlmSettings = LlmSettings()
    """HYATLAS_LLM_*: the model, its key and fallback, call timeout and reply cap."""
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
    user_aliases: Aliases = Aliases()
    """HYATLAS_USER_ALIASES: ids of one person are consolidated together."""
    budget_s: float = 600.0
    """How long one pass may keep starting calls."""
    min_call_estimate_s: float = 180.0
    """The least time a call is expected to take when deciding whether to start one."""
    lease_ttl_s: float = 60.0
    """HYATLAS_LEASE_TTL: how long a pass's lease (one pass at a time among replicas) lasts
    unrenewed; a replica killed during a pass frees it after this."""
    lease_poll_s: float = 0.5
    """How often a revert waiting for a pass to end asks for the lease again."""
    warn_every_s: float = 10.0
    """How long start-up waits for the store and the embedder to serve before it warns that it
    still waits, and then between such warnings (it waits as long as it takes)."""
    grpc_token: str = ""
    """HYATLAS_GRPC_TOKEN: sent on calls out and required on a TCP listen address."""
    log_level: str = "INFO"
    """HYATLAS_LOG_LEVEL: the process's log level."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ConsolidatorConfig:
        """Reads the HYATLAS_* settings the consolidator uses."""
        env = os.environ if environ is None else environ
        settings = Settings.from_env(env)
        return cls(
            address=settings.listen_address("consolidator"),
            store_address=settings.address("store"),
            embedder_address=settings.address("embedder"),
            mode=settings.mode,
            llm=settings.llm,
            every_s=settings.consolidate_every_s or 6 * 3600.0,
            catchup_s=settings.consolidate_catchup_s,
            batch=settings.consolidate_batch,
            parallel=settings.consolidate_parallel,
            graph=settings.consolidate_graph,
            recluster_s=settings.consolidate_recluster_s,
            cross_schema_every_s=settings.cross_schema_every_s,
            raw_retention_s=settings.raw_retention_s,
            user_aliases=settings.user_aliases,
            lease_ttl_s=lease_ttl_setting(env),
            grpc_token=settings.grpc_token,
            log_level=settings.log_level,
        )
