"""The embedder's configuration, read once from HYATLAS_* variables."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shared.errors import ConfigError
from shared.settings import Settings

Backend = Literal["onnx", "local", "remote"]


@dataclass(frozen=True)
class EmbedderConfig:
    """Where the embedder listens, which model it runs and how it batches."""

    address: str
    """HYATLAS_EMBEDDER_LISTEN or _ADDR: the one endpoint to serve on (unix:PATH or HOST:PORT)."""
    backend: Backend = "onnx"
    """From HYATLAS_EMBED_BASE: onnx (bge, the default), local (hash stub) or remote (a URL)."""
    model_dir: Path | None = None
    """HYATLAS_MODEL_DIR: the only folder searched for the ONNX model when set."""
    previous_model_dir: Path | None = None
    """HYATLAS_PREVIOUS_MODEL_DIR: a model loaded on request beside the configured one (the
    model a store was built with, while a re-embed moves it over)."""
    remote_base: str = ""
    """HYATLAS_EMBED_BASE when it is a URL: an OpenAI-compatible API base."""
    remote_model: str = "text-embedding-3-small"
    """HYATLAS_EMBED_MODEL: the model name sent to the remote endpoint."""
    remote_key: str = ""
    """HYATLAS_EMBED_KEY: the remote endpoint's bearer token."""
    remote_timeout_s: float = 60.0
    """How long one remote embeddings call may take."""
    threads: int = 2
    """HYATLAS_EMBED_THREADS: onnxruntime intra-op threads."""
    runs: int = 1
    """HYATLAS_EMBED_RUNS: model runs in flight at once (they share one run's token budget)."""
    max_batch: int = 64
    """HYATLAS_EMBED_MAX_BATCH: most texts in one model run."""
    pooled_spans: bool = True
    """HYATLAS_EMBED_POOLED_SPANS: spans pooled from their text's run, else embedded alone."""
    max_queue: int = 256
    """HYATLAS_EMBED_MAX_QUEUE: most vectors waiting to be made; more are refused."""
    grpc_token: str = ""
    """HYATLAS_GRPC_TOKEN: sent on calls out and required on a TCP listen address."""
    log_level: str = "INFO"
    """HYATLAS_LOG_LEVEL: the process's log level."""

    @classmethod
    def from_settings(cls, settings: Settings) -> EmbedderConfig:
        """The embedder's part of the project settings."""
        base = settings.embed_base.strip()
        backend: Backend
        if base.lower() in ("", "bge"):
            backend, remote_base = "onnx", ""
        elif base.lower() == "local":
            backend, remote_base = "local", ""
        elif base.lower().startswith(("http://", "https://")):
            backend, remote_base = "remote", base.rstrip("/")
        else:
            raise ConfigError(
                f"HYATLAS_EMBED_BASE={base!r} is not one of bge, local or an http(s) URL"
            )
        return cls(
            address=settings.listen_address("embedder"),
            backend=backend,
            model_dir=settings.model_dir,
            remote_base=remote_base,
            remote_model=settings.embed_model,
            remote_key=settings.embed_key,
            threads=settings.embed_threads,
            runs=settings.embed_runs,
            max_batch=settings.embed_max_batch,
            pooled_spans=settings.embed_pooled_spans,
            max_queue=settings.embed_max_queue,
            grpc_token=settings.grpc_token,
            log_level=settings.log_level,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EmbedderConfig:
        """Reads the embedder's settings from the environment."""
        env = os.environ if environ is None else environ
        previous = env.get("HYATLAS_PREVIOUS_MODEL_DIR", "").strip()
        return dataclasses.replace(
            cls.from_settings(Settings.from_env(env)),
            previous_model_dir=Path(previous).expanduser() if previous else None,
        )
