"""The gateway's settings, read once from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.settings import Settings

MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class GatewayConfig:
    """What the gateway needs: where to listen, whom to call, which guards to apply."""

    http_host: str = "127.0.0.1"
    """HYATLAS_GO_HOST: the bind address."""
    http_port: int = 19528
    """HYATLAS_GO_PORT: the port (0 picks a free one)."""
    embedder_address: str = "unix:data/run/embedder.sock"
    """HYATLAS_EMBEDDER_ADDR: the embedder's gRPC address (readiness only: the store calls it)."""
    store_address: str = "unix:data/run/store.sock"
    """HYATLAS_STORE_ADDR: the store's gRPC address."""
    search_address: str = "unix:data/run/search.sock"
    """HYATLAS_SEARCH_ADDR: the search service's gRPC address."""
    extractor_address: str = "unix:data/run/extractor.sock"
    """HYATLAS_EXTRACTOR_ADDR: the extractor's gRPC address (pro and ultra)."""
    consolidator_address: str = "unix:data/run/consolidator.sock"
    """HYATLAS_CONSOLIDATOR_ADDR: the consolidator's gRPC address (ultra)."""
    allowed_hosts: frozenset[str] = frozenset()
    """HYATLAS_ALLOWED_HOSTS: DNS names accepted in Host and Origin."""
    token: str = ""
    """HYATLAS_TOKEN: when set, every route but /healthz and /readyz needs a bearer token."""
    tokens_file: Path | None = None
    """HYATLAS_TOKENS_FILE: named tokens, each granting some owners and scopes."""
    grpc_token: str = ""
    """HYATLAS_GRPC_TOKEN: sent with every call to the services."""
    admin: bool = False
    """HYATLAS_ADMIN: enables bulk delete and the /api/v1/admin routes."""
    mode: str = "ultra"
    """HYATLAS_MODE: lite | pro | ultra."""
    sync_extract: bool = False
    """HYATLAS_SYNC_EXTRACT: whether a write waits for its extraction."""
    startup_wait_s: float = 10.0
    """HYATLAS_STARTUP_WAIT: how long a write waits for a store that is not answering yet."""
    extract_timeout_s: float = 300.0
    """HYATLAS_EXTRACT_TIMEOUT: bounds how long a synchronous write waits for extraction."""
    llm_model: str = ""
    """HYATLAS_LLM_MODEL: reported by status."""
    llm_base: str = ""
    """HYATLAS_LLM_BASE: reported by status."""
    catchup_max_age_s: float | None = 168 * 3600.0
    """HYATLAS_CATCHUP_MAX_AGE: status counts no older turn as unextracted (catch-up takes none)."""
    usage_learning: bool = True
    """HYATLAS_USAGE_LEARNING: whether /api/v1/feedback records which memories replies used."""
    consolidate_graph: bool = True
    """HYATLAS_CONSOLIDATE_GRAPH: whether the ultra pass builds the L5 graph (status wording)."""
    data_dir: Path = field(default_factory=lambda: Path("data"))
    """HYATLAS_GO_DATA: reported by status when the store does not say."""
    header_timeout_s: float = 30.0
    """HYATLAS_HEADER_TIMEOUT: longest wait for a whole request head (and keep-alive idle time)."""
    body_timeout_s: float = 60.0
    """HYATLAS_BODY_TIMEOUT: longest wait for a whole request body (a streamed one: a chunk)."""
    max_body_bytes: int = MAX_BODY_BYTES
    """Largest request body accepted; larger ones get 413."""
    rpc_timeout_s: float = 5.0
    """HYATLAS_READ_DEADLINE: deadline of one backing-service call of a reading route."""
    write_deadline_s: float = 8.0
    """HYATLAS_WRITE_DEADLINE: deadline of one backing-service call of a writing route."""
    max_in_flight: int = 8
    """HYATLAS_MAX_IN_FLIGHT: API requests worked on at once; more wait, then get 503."""
    queue_wait_s: float = 1.0
    """HYATLAS_QUEUE_WAIT: how long a request past max_in_flight waits for a slot."""
    log_level: str = "INFO"
    """HYATLAS_LOG_LEVEL: the process's log level."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GatewayConfig:
        """Builds the config from HYATLAS_* variables (ConfigError names a bad one)."""
        settings = Settings.from_env(os.environ if environ is None else environ)
        return cls.from_settings(settings)

    @classmethod
    def from_settings(cls, settings: Settings) -> GatewayConfig:
        """Takes the gateway's part of the parsed settings."""
        return cls(
            http_host=settings.http_host,
            http_port=settings.http_port,
            embedder_address=settings.address("embedder"),
            store_address=settings.address("store"),
            search_address=settings.address("search"),
            extractor_address=settings.address("extractor"),
            consolidator_address=settings.address("consolidator"),
            allowed_hosts=settings.allowed_hosts,
            token=settings.token,
            tokens_file=settings.tokens_file,
            grpc_token=settings.grpc_token,
            admin=settings.admin,
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            usage_learning=settings.usage_learning,
            mode=settings.mode,
            sync_extract=settings.sync_extract,
            startup_wait_s=settings.startup_wait_s,
            rpc_timeout_s=settings.read_deadline_s,
            write_deadline_s=settings.write_deadline_s,
            max_in_flight=settings.max_in_flight,
            queue_wait_s=settings.queue_wait_s,
            extract_timeout_s=settings.llm.timeout_s,
            llm_model=settings.llm.model,
            llm_base=settings.llm.base,
            catchup_max_age_s=settings.catchup_max_age_s,
            consolidate_graph=settings.consolidate_graph,
            data_dir=settings.data_dir,
            log_level=settings.log_level,
        )
