"""The store service's settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.store.index import DEFAULT_BUDGET_BYTES
from services.store.reembed import ReembedPlan
from services.store.snapshot import SnapshotPlan
from shared.aliases import Aliases
from shared.errors import ConfigError
from shared.settings import OFF_WORDS, Settings, read_duration, read_int


@dataclass(frozen=True)
class StoreConfig:
    """What the store needs to run."""

    data_dir: Path
    """The data directory; the store alone reads and writes it."""
    address: str
    """HYATLAS_STORE_LISTEN or _ADDR: the one endpoint to serve on."""
    embedder_address: str
    """The embedder's gRPC address; every stored text is embedded there."""
    store_dsn: str = ""
    """HYATLAS_STORE_DSN: a postgresql:// URL to keep everything in PostgreSQL with pgvector
    (several store replicas may share it); empty for SQLite in the data directory."""
    user_aliases: Aliases = Aliases()
    """Groups of user ids that are one person: a scope reaches the whole group."""
    save_every_s: float | None = 30.0
    """How often changed vector indexes are saved (None: only on Flush and shutdown)."""
    exact_search_up_to: int = 20_000
    """An owner's index up to this size is searched by brute force, larger ones by HNSW."""
    index_cache_bytes: int = DEFAULT_BUDGET_BYTES
    """HYATLAS_INDEX_CACHE_MB: memory the loaded vector indexes may take before the least
    recently used are saved and dropped (they load again on demand)."""
    embedder_warn_every_s: float = 10.0
    """How long start-up waits for the embedder to serve before it warns that it still waits,
    and then between such warnings (it waits as long as it takes)."""
    grpc_token: str = ""
    """HYATLAS_GRPC_TOKEN: sent on calls out and required on a TCP listen address."""
    log_level: str = "INFO"
    """HYATLAS_LOG_LEVEL: the process's log level."""
    snapshots: SnapshotPlan | None = None
    """HYATLAS_SNAPSHOT_*: where snapshots go, how many are kept and how often (None: defaults)."""
    reembed: ReembedPlan = ReembedPlan()
    """HYATLAS_REEMBED_*: how a re-embed to a newly configured model batches and paces itself."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreConfig:
        """Reads the HYATLAS_* settings the store uses."""
        env = os.environ if environ is None else environ
        settings = Settings.from_env(env)
        return cls(
            data_dir=settings.data_dir,
            address=settings.listen_address("store"),
            embedder_address=settings.address("embedder"),
            store_dsn=read_dsn(env),
            user_aliases=settings.user_aliases,
            save_every_s=read_duration(env, "HYATLAS_STORE_SAVE_EVERY", 30.0),
            index_cache_bytes=read_megabytes(env, "HYATLAS_INDEX_CACHE_MB", DEFAULT_BUDGET_BYTES),
            grpc_token=settings.grpc_token,
            log_level=settings.log_level,
            snapshots=SnapshotPlan(
                folder=settings.snapshot_dir,
                keep=settings.snapshot_keep,
                every_s=settings.snapshot_every_s,
                skip=(settings.run_dir, settings.snapshot_dir.resolve()),
            ),
            reembed=ReembedPlan(
                batch=read_int(env, "HYATLAS_REEMBED_BATCH", 64, 1, 1024),
                rows_per_s=read_rate(env, "HYATLAS_REEMBED_ROWS_PER_S"),
            ),
        )


def read_dsn(env: Mapping[str, str]) -> str:
    """HYATLAS_STORE_DSN: empty, or a PostgreSQL URL; anything else is a ConfigError."""
    dsn = env.get("HYATLAS_STORE_DSN", "").strip()
    if dsn and not dsn.startswith(("postgresql://", "postgres://")):
        raise ConfigError(
            "HYATLAS_STORE_DSN must be a postgresql:// URL (or unset for SQLite), "
            f"not one starting {dsn.split(':', 1)[0]!r}"
        )
    return dsn


def read_megabytes(env: Mapping[str, str], name: str, default: int) -> int:
    """A size in MiB from the environment, in bytes; a value that is not a positive whole
    number is a ConfigError."""
    text = env.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) == 0:
        raise ConfigError(f"{name} must be a positive whole number of MiB, not {text!r}")
    return int(text) << 20


def read_rate(env: Mapping[str, str], name: str) -> float | None:
    """A positive number per second, or None when unset or off; anything else is a ConfigError."""
    text = env.get(name, "").strip()
    if not text or text.lower() in OFF_WORDS:
        return None
    try:
        rate = float(text)
    except ValueError:
        rate = 0.0
    if not 0 < rate < float("inf"):
        raise ConfigError(f"{name} must be a positive number (or off), not {text!r}")
    return rate
