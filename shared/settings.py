"""Every HYATLAS_* setting, parsed once with the reference's rules."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.addresses import channel_target, endpoints, is_loopback_host, is_unix
from shared.aliases import Aliases
from shared.errors import ConfigError

log = logging.getLogger(__name__)

MODES = ("lite", "pro", "ultra")
LLM_MODES = ("pro", "ultra")
"""The modes that call an LLM on writes."""
SERVICES = ("embedder", "store", "search", "extractor", "consolidator")
MODE_SERVICES = {
    "lite": ("embedder", "store", "search"),
    "pro": ("embedder", "store", "search", "extractor"),
    "ultra": SERVICES,
}
"""The backing services each mode runs: lite stores and searches with no LLM; pro adds the
extractor (its LLM calls, Now pages, episodes); ultra adds the consolidator (the slow path)."""
BACKGROUND_SERVICES = frozenset({"consolidator"})
"""Services no write or search waits for (the slow path runs behind them): a node is ready to
serve without them, as a node of a cluster whose consolidator runs on another is."""
OFF_WORDS = frozenset({"0", "off", "false", "no"})
ON_WORDS = frozenset({"1", "on", "true", "yes"})

_GO_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_GO_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_go_duration(text: str) -> float:
    """Seconds in a Go duration ("1h30m", "300ms", "-2s"); ValueError if it is not one."""
    s = text.strip()
    sign = 1.0
    if s and s[0] in "+-":
        sign = -1.0 if s[0] == "-" else 1.0
        s = s[1:]
    if s == "0":
        return 0.0
    if not s:
        raise ValueError(f"not a duration: {text!r}")
    total, pos = 0.0, 0
    for match in _GO_PART.finditer(s):
        if match.start() != pos:
            raise ValueError(f"not a duration: {text!r}")
        total += float(match.group(1)) * _GO_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(s):
        raise ValueError(f"not a duration: {text!r}")
    return sign * total


def read_duration(environ: Mapping[str, str], name: str, default: float | None) -> float | None:
    """A duration setting in seconds; None means off.

    Go durations or bare seconds; 0/off/false/no turn the feature off; empty keeps the default;
    anything else, a negative duration included, logs a line and keeps the default, so a typo
    never changes a schedule silently.
    """
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() in OFF_WORDS:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            value = parse_go_duration(raw)
        except ValueError:
            log.warning("%s=%r is not a duration; using the default", name, raw)
            return default
    if not math.isfinite(value) or value < 0:
        log.warning("%s=%r is not a duration; using the default", name, raw)
        return default
    if value == 0:
        return None
    return value


def read_duration_always_on(environ: Mapping[str, str], name: str, default: float) -> float:
    """A duration setting that cannot be turned off: 0/off logs a line and keeps the default,
    as an unparsable value does."""
    value = read_duration(environ, name, default)
    if value is None:
        log.warning("%s=%r cannot be turned off; using the default", name, environ[name])
        return default
    return value


def read_switch(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """An on/off setting; an unknown word logs and keeps the default."""
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ON_WORDS:
        return True
    if raw in OFF_WORDS:
        return False
    log.warning("%s=%r is neither on nor off; using the default", name, raw)
    return default


def read_float(
    environ: Mapping[str, str], name: str, default: float, lo: float, hi: float
) -> float:
    """A number within [lo, hi]; anything else is a ConfigError naming the variable."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not (lo <= value <= hi):
        raise ConfigError(f"{name}={raw!r} is outside {lo}..{hi}")
    return value


def read_int(environ: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    """A whole number within [lo, hi]; anything else is a ConfigError naming the variable."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number") from None
    if not (lo <= value <= hi):
        raise ConfigError(f"{name}={raw!r} is outside {lo}..{hi}")
    return value


def _host_entries(raw: str) -> frozenset[str]:
    hosts = set()
    for entry in raw.split(","):
        entry = entry.strip().lower()
        if not entry:
            continue
        if entry.startswith("["):
            entry = entry[1:].split("]", 1)[0]
        elif entry.count(":") == 1:
            entry = entry.split(":", 1)[0]
        hosts.add(entry)
    return frozenset(hosts)


@dataclass(frozen=True)
class LlmSettings:
    """Where and how a service calls the LLM: the HYATLAS_LLM_* settings in one place."""

    base: str = ""
    """HYATLAS_LLM_BASE: the primary OpenAI-compatible endpoint."""
    model: str = ""
    """HYATLAS_LLM_MODEL: the primary model."""
    key: str = ""
    """HYATLAS_LLM_KEY: the key used when no posted key or key file gives one."""
    key_file: str = ""
    """HYATLAS_LLM_KEY_FILE: a plain-text key file, read on every call."""
    fallback_model: str = ""
    """HYATLAS_LLM_FALLBACK_MODEL: tried when the primary fails; empty: no fallback."""
    fallback_base: str = ""
    """HYATLAS_LLM_FALLBACK_BASE: the fallback's endpoint (empty: the primary's)."""
    fallback_key: str | None = None
    """HYATLAS_LLM_FALLBACK_KEY: None reuses the primary's key on the primary's host only."""
    timeout_s: float = 300.0
    """HYATLAS_EXTRACT_TIMEOUT: how long one call may take."""
    max_tokens: int = 1024
    """HYATLAS_LLM_MAX_TOKENS: the longest reply a call may ask for."""

    @property
    def endpoint(self) -> bool:
        """Whether base and model are set (a key may still arrive)."""
        return bool(self.base and self.model)

    @property
    def configured(self) -> bool:
        """Whether base, model and a key source are all set."""
        return self.endpoint and bool(self.key or self.key_file)


@dataclass(frozen=True)
class Settings:
    """The server's settings, as HYATLAS_* variables give them."""

    data_dir: Path = Path("data")
    """HYATLAS_GO_DATA: the data directory; only the store writes in it."""
    run_dir: Path = Path("data/run")
    """HYATLAS_RUN_DIR: where the services' unix sockets live (default <data>/run)."""
    addresses: Mapping[str, str] = field(default_factory=dict)
    """HYATLAS_<SERVICE>_ADDR: where each service is called: unix:PATH or HOST:PORT, or a
    comma-separated list of its replicas' endpoints, which take calls in turn."""
    listen: Mapping[str, str] = field(default_factory=dict)
    """HYATLAS_<SERVICE>_LISTEN: the one endpoint a service serves on; unset, entry number
    HYATLAS_<SERVICE>_REPLICA (from 0) of its address, or its address when that names one
    endpoint (a replica of a list must be told which entry is its own)."""
    http_host: str = "127.0.0.1"
    """HYATLAS_GO_HOST: the gateway's bind address."""
    http_port: int = 19528
    """HYATLAS_GO_PORT: the gateway's port."""
    allowed_hosts: frozenset[str] = frozenset()
    """HYATLAS_ALLOWED_HOSTS: DNS names accepted in Host and Origin besides loopback and IPs."""
    token: str = ""
    """HYATLAS_TOKEN: a bearer token every route but /healthz requires when set."""
    tokens_file: Path | None = None
    """HYATLAS_TOKENS_FILE: a JSON file of named tokens, each granting some owners and scopes."""
    grpc_token: str = ""
    """HYATLAS_GRPC_TOKEN: the token services send and require on TCP gRPC addresses."""
    admin: bool = False
    """HYATLAS_ADMIN: enables bulk delete and the /api/v1/admin routes."""
    header_timeout_s: float = 30.0
    """HYATLAS_HEADER_TIMEOUT: a connection that has not sent a whole request head this long
    after it opened (or after its last reply) is closed; also the keep-alive idle time."""
    body_timeout_s: float = 60.0
    """HYATLAS_BODY_TIMEOUT: a request body must arrive in full within this long (an import
    stream: each chunk), or the answer is 408 and the connection is closed."""

    embed_base: str = "bge"
    """HYATLAS_EMBED_BASE: bge (the local ONNX model), local (deterministic stub) or a URL."""
    embed_model: str = "text-embedding-3-small"
    """HYATLAS_EMBED_MODEL: the model name sent to an HTTP embedder."""
    embed_key: str = ""
    """HYATLAS_EMBED_KEY: bearer token for an HTTP embedder."""
    model_dir: Path | None = None
    """HYATLAS_MODEL_DIR: a folder holding the ONNX model and its tokenizer."""
    embed_threads: int = 2
    """HYATLAS_EMBED_THREADS: onnxruntime intra-op threads."""
    embed_runs: int = 1
    """HYATLAS_EMBED_RUNS: model runs in flight at once (they share one run's token budget)."""
    embed_max_batch: int = 64
    """HYATLAS_EMBED_MAX_BATCH: most texts in one model run."""
    embed_pooled_spans: bool = True
    """HYATLAS_EMBED_POOLED_SPANS: a memory's sentences get vectors pooled from its own model
    run (one model input a memory); off embeds each sentence alone."""
    embed_max_queue: int = 256
    """HYATLAS_EMBED_MAX_QUEUE: most vectors waiting to be made; past it, RESOURCE_EXHAUSTED."""

    mode: str = "ultra"
    """HYATLAS_MODE: lite | pro | ultra."""
    sync_extract: bool = False
    """HYATLAS_SYNC_EXTRACT: whether a write waits for extraction (default: pro on, ultra off)."""
    llm: LlmSettings = LlmSettings()
    """The HYATLAS_LLM_* settings and HYATLAS_EXTRACT_TIMEOUT."""
    startup_wait_s: float = 10.0
    """HYATLAS_STARTUP_WAIT: how long a request waits for a store that is not answering yet."""
    max_in_flight: int = 8
    """HYATLAS_MAX_IN_FLIGHT: API requests the gateway works on at once."""
    queue_wait_s: float = 1.0
    """HYATLAS_QUEUE_WAIT: how long a request past that limit waits for a slot before a 503."""
    read_deadline_s: float = 5.0
    """HYATLAS_READ_DEADLINE: deadline of one backing-service call of a reading route."""
    write_deadline_s: float = 8.0
    """HYATLAS_WRITE_DEADLINE: deadline of one backing-service call of a writing route."""
    reconcile: bool = False
    """HYATLAS_RECONCILE: a second LLM call on similar facts after extraction."""

    consolidate_every_s: float | None = 6 * 3600.0
    """HYATLAS_CONSOLIDATE_EVERY: interval between slow-path passes (ultra)."""
    consolidate_batch: int = 50
    """HYATLAS_CONSOLIDATE_BATCH: most facts per owner per consolidation call."""
    consolidate_graph: bool = True
    """HYATLAS_CONSOLIDATE_GRAPH: whether consolidation writes L5 edges and the arc."""
    consolidate_parallel: int = 2
    """HYATLAS_CONSOLIDATE_PARALLEL: consolidation calls at once (1 to 4)."""
    consolidate_catchup_s: float | None = 20 * 60.0
    """HYATLAS_CONSOLIDATE_CATCHUP: interval between passes while clusters are due."""
    consolidate_recluster_s: float | None = None
    """HYATLAS_CONSOLIDATE_RECLUSTER: rebuild an owner's clusters after this long."""
    cross_schema_every_s: float | None = 24 * 3600.0
    """HYATLAS_CROSS_SCHEMA_EVERY: least time between cross-topic schema passes per owner."""
    raw_retention_s: float | None = None
    """HYATLAS_RAW_RETENTION: age after which uncited raw rows are deleted (ultra, opt-in)."""

    user_aliases: Aliases = Aliases()
    """HYATLAS_USER_ALIASES: groups of user ids that are one person."""
    min_score: float = 0.60
    """HYATLAS_MIN_SCORE: vector hits below this cosine are dropped; 0 disables the floor."""
    min_score_set: bool = False
    """Whether HYATLAS_MIN_SCORE was given; if not, search uses the model's calibrated floor."""
    dedupe_score: float = 0.92
    """HYATLAS_DEDUPE_SCORE: a new fact this similar to a live one supersedes it; 0 disables."""
    catchup_every_s: float | None = 600.0
    """HYATLAS_CATCHUP_EVERY: how often unextracted raw rows are re-extracted."""
    catchup_max_age_s: float | None = 168 * 3600.0
    """HYATLAS_CATCHUP_MAX_AGE: the oldest raw row catch-up takes; None: no limit."""
    recency: bool = True
    """HYATLAS_RECENCY: newer memories win close calls in search."""
    mmr_lambda: float = 0.75
    """HYATLAS_MMR_LAMBDA: relevance weight of the diversity pass; 1 turns it off."""
    intention_ttl_s: float | None = 168 * 3600.0
    """HYATLAS_INTENTION_TTL: how long an undated intention stays in search results."""
    usage_learning: bool = True
    """HYATLAS_USAGE_LEARNING: search learns from which recalled memories replies used."""
    episode_gap_s: float | None = 30 * 60.0
    """HYATLAS_EPISODE_GAP: a gap that ends an episode of work; None: no episode summaries."""
    now_every_s: float | None = 15 * 60.0
    """HYATLAS_NOW_EVERY: least time between Now page rebuilds; None: after every write."""
    snapshot_every_s: float | None = 24 * 3600.0
    """HYATLAS_SNAPSHOT_EVERY: how often the data directory is zipped."""
    snapshot_keep: int = 7
    """HYATLAS_SNAPSHOT_KEEP: how many snapshots to keep."""
    snapshot_dir: Path = Path("data-snapshots")
    """HYATLAS_SNAPSHOT_DIR: where snapshots go (default: <data>-snapshots)."""
    log_level: str = "INFO"
    """HYATLAS_LOG_LEVEL: the services' log level."""

    @property
    def uses_llm(self) -> bool:
        """Whether the mode makes LLM calls at all."""
        return self.mode != "lite"

    def address(self, service: str) -> str:
        """Where one service is called (one endpoint or a list of replicas)."""
        return self.addresses[service]

    def listen_address(self, service: str) -> str:
        """The one endpoint this process serves on when it runs `service`."""
        if service not in self.listen:
            raise ConfigError(
                f"HYATLAS_{service.upper()}_ADDR={self.addresses[service]!r} lists several "
                f"endpoints: set HYATLAS_{service.upper()}_LISTEN to the one this {service} "
                "serves on"
            )
        return self.listen[service]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Reads every setting; a value that cannot run is a ConfigError naming its variable."""
        env = os.environ if environ is None else environ

        def text(name: str, default: str = "") -> str:
            return env.get(name, "").strip() or default

        data_dir = Path(text("HYATLAS_GO_DATA", "./data")).expanduser().resolve()
        run_dir = Path(text("HYATLAS_RUN_DIR", str(data_dir / "run"))).expanduser().resolve()
        addresses = {
            name: text(f"HYATLAS_{name.upper()}_ADDR", f"unix:{run_dir / (name + '.sock')}")
            for name in SERVICES
        }
        listen = _listen_addresses(env, addresses)

        grpc_token = text("HYATLAS_GRPC_TOKEN")
        _check_tcp_token(env, grpc_token)
        tokens_file = text("HYATLAS_TOKENS_FILE")

        mode = text("HYATLAS_MODE", "ultra").lower()
        if mode not in MODES:
            raise ConfigError(f"HYATLAS_MODE={mode!r} is not one of {', '.join(MODES)}")
        sync_raw = text("HYATLAS_SYNC_EXTRACT").lower()
        if not sync_raw:
            sync_extract = mode == "pro"
        elif sync_raw in ON_WORDS:
            sync_extract = True
        elif sync_raw in OFF_WORDS:
            sync_extract = False
        else:
            raise ConfigError(f"HYATLAS_SYNC_EXTRACT={sync_raw!r} is not one of on, off")

        consolidate_every = read_duration(env, "HYATLAS_CONSOLIDATE_EVERY", 6 * 3600.0)
        if mode == "ultra" and consolidate_every is None:
            raise ConfigError(
                "HYATLAS_CONSOLIDATE_EVERY must be positive in ultra mode; use pro to run "
                "without the consolidation pass"
            )

        port = read_int(env, "HYATLAS_GO_PORT", 19528, 0, 65535)
        host = text("HYATLAS_GO_HOST", "127.0.0.1")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        token = text("HYATLAS_TOKEN")
        _check_api_token(host, token, tokens_file)
        model_dir_raw = text("HYATLAS_MODEL_DIR")
        fallback_key = env.get("HYATLAS_LLM_FALLBACK_KEY")
        level = text("HYATLAS_LOG_LEVEL", "INFO").upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(
                f"HYATLAS_LOG_LEVEL={level!r} is not one of DEBUG, INFO, WARNING, ERROR"
            )

        return cls(
            data_dir=data_dir,
            run_dir=run_dir,
            addresses=addresses,
            listen=listen,
            http_host=host,
            http_port=port,
            allowed_hosts=_host_entries(text("HYATLAS_ALLOWED_HOSTS")),
            token=token,
            tokens_file=Path(tokens_file).expanduser() if tokens_file else None,
            grpc_token=grpc_token,
            admin=read_switch(env, "HYATLAS_ADMIN", False),
            header_timeout_s=_read_timeout(env, "HYATLAS_HEADER_TIMEOUT", 30.0),
            body_timeout_s=_read_timeout(env, "HYATLAS_BODY_TIMEOUT", 60.0),
            embed_base=text("HYATLAS_EMBED_BASE", "bge"),
            embed_model=text("HYATLAS_EMBED_MODEL", "text-embedding-3-small"),
            embed_key=text("HYATLAS_EMBED_KEY"),
            model_dir=Path(model_dir_raw).expanduser() if model_dir_raw else None,
            embed_threads=read_int(env, "HYATLAS_EMBED_THREADS", 2, 1, 64),
            embed_runs=read_int(env, "HYATLAS_EMBED_RUNS", 1, 1, 8),
            embed_max_batch=read_int(env, "HYATLAS_EMBED_MAX_BATCH", 64, 1, 1024),
            embed_pooled_spans=read_switch(env, "HYATLAS_EMBED_POOLED_SPANS", True),
            embed_max_queue=read_int(env, "HYATLAS_EMBED_MAX_QUEUE", 256, 1, 1_000_000),
            mode=mode,
            sync_extract=sync_extract,
            llm=LlmSettings(
                base=text("HYATLAS_LLM_BASE"),
                model=text("HYATLAS_LLM_MODEL"),
                key=text("HYATLAS_LLM_KEY"),
                key_file=text("HYATLAS_LLM_KEY_FILE"),
                fallback_model=text("HYATLAS_LLM_FALLBACK_MODEL"),
                fallback_base=text("HYATLAS_LLM_FALLBACK_BASE"),
                fallback_key=fallback_key.strip() if fallback_key is not None else None,
                timeout_s=read_duration_always_on(env, "HYATLAS_EXTRACT_TIMEOUT", 300.0),
                max_tokens=read_int(env, "HYATLAS_LLM_MAX_TOKENS", 1024, 16, 1_000_000),
            ),
            startup_wait_s=read_duration(env, "HYATLAS_STARTUP_WAIT", 10.0) or 0.0,
            max_in_flight=read_int(env, "HYATLAS_MAX_IN_FLIGHT", 8, 1, 100_000),
            queue_wait_s=read_duration(env, "HYATLAS_QUEUE_WAIT", 1.0) or 0.0,
            read_deadline_s=_deadline(env, "HYATLAS_READ_DEADLINE", 5.0),
            write_deadline_s=_deadline(env, "HYATLAS_WRITE_DEADLINE", 8.0),
            reconcile=read_switch(env, "HYATLAS_RECONCILE", False),
            consolidate_every_s=consolidate_every,
            consolidate_batch=read_int(env, "HYATLAS_CONSOLIDATE_BATCH", 50, 2, 1000),
            consolidate_graph=read_switch(env, "HYATLAS_CONSOLIDATE_GRAPH", True),
            consolidate_parallel=read_int(env, "HYATLAS_CONSOLIDATE_PARALLEL", 2, 1, 4),
            consolidate_catchup_s=read_duration(env, "HYATLAS_CONSOLIDATE_CATCHUP", 20 * 60.0),
            consolidate_recluster_s=read_duration(env, "HYATLAS_CONSOLIDATE_RECLUSTER", None),
            cross_schema_every_s=read_duration(env, "HYATLAS_CROSS_SCHEMA_EVERY", 24 * 3600.0),
            raw_retention_s=read_duration(env, "HYATLAS_RAW_RETENTION", None),
            user_aliases=Aliases.parse(text("HYATLAS_USER_ALIASES")),
            min_score=read_float(env, "HYATLAS_MIN_SCORE", 0.60, 0.0, 1.0),
            min_score_set=bool(text("HYATLAS_MIN_SCORE")),
            dedupe_score=read_float(env, "HYATLAS_DEDUPE_SCORE", 0.92, 0.0, 1.0),
            catchup_every_s=read_duration(env, "HYATLAS_CATCHUP_EVERY", 600.0),
            catchup_max_age_s=read_duration(env, "HYATLAS_CATCHUP_MAX_AGE", 168 * 3600.0),
            recency=read_switch(env, "HYATLAS_RECENCY", True),
            mmr_lambda=_mmr_lambda(env),
            intention_ttl_s=read_duration(env, "HYATLAS_INTENTION_TTL", 168 * 3600.0),
            usage_learning=read_switch(env, "HYATLAS_USAGE_LEARNING", True),
            episode_gap_s=read_duration(env, "HYATLAS_EPISODE_GAP", 30 * 60.0),
            now_every_s=read_duration(env, "HYATLAS_NOW_EVERY", 15 * 60.0),
            snapshot_every_s=read_duration(env, "HYATLAS_SNAPSHOT_EVERY", 24 * 3600.0),
            snapshot_keep=read_int(env, "HYATLAS_SNAPSHOT_KEEP", 7, 1, 10_000),
            snapshot_dir=Path(
                text("HYATLAS_SNAPSHOT_DIR", str(data_dir) + "-snapshots")
            ).expanduser(),
            log_level=level,
        )


def _deadline(env: Mapping[str, str], name: str, default: float) -> float:
    value = read_duration(env, name, default)
    if value is None:
        raise ConfigError(f"{name}={env.get(name)!r} must be a positive duration")
    return value


def _listen_addresses(env: Mapping[str, str], addresses: Mapping[str, str]) -> dict[str, str]:
    """Each service's own endpoint (HYATLAS_<SERVICE>_LISTEN, else its one address), once every
    address is checked to be one gRPC target; a service whose address lists several and that is
    not told which is its own has none here (listen_address says so to that service alone)."""
    listen = {}
    for name, address in addresses.items():
        try:
            channel_target(address)
        except ValueError as exc:
            raise ConfigError(f"HYATLAS_{name.upper()}_ADDR={address!r} {exc}") from None
        own = env.get(f"HYATLAS_{name.upper()}_LISTEN", "").strip()
        if len(endpoints(own)) > 1:
            raise ConfigError(
                f"HYATLAS_{name.upper()}_LISTEN={own!r} must be one endpoint, not a list"
            )
        replica = env.get(f"HYATLAS_{name.upper()}_REPLICA", "").strip()
        if own:
            listen[name] = own
        elif replica:
            listen[name] = _replica_endpoint(env, name, address)
        elif len(endpoints(address)) == 1:
            listen[name] = address
    return listen


def _replica_endpoint(env: Mapping[str, str], name: str, address: str) -> str:
    """The entry of a service's address list that HYATLAS_<SERVICE>_REPLICA numbers (from 0)."""
    entries = endpoints(address)
    index = read_int(env, f"HYATLAS_{name.upper()}_REPLICA", 0, 0, len(entries) - 1)
    return entries[index]


def _check_tcp_token(env: Mapping[str, str], grpc_token: str) -> None:
    """Refuses a TCP service endpoint without a service token: gRPC has no other guard."""
    if grpc_token:
        return
    for name in SERVICES:
        for variable in (f"HYATLAS_{name.upper()}_ADDR", f"HYATLAS_{name.upper()}_LISTEN"):
            value = env.get(variable, "").strip()
            if not all(is_unix(endpoint) for endpoint in endpoints(value)):
                raise ConfigError(
                    f"{variable}={value!r} is a TCP address: set "
                    "HYATLAS_GRPC_TOKEN so that only the services can call it"
                )


def _check_api_token(host: str, token: str, tokens_file: str) -> None:
    """Refuses a gateway listening beyond loopback without an API token: it would give anyone
    on the network full read and write, as gRPC on TCP would without its token."""
    if token or tokens_file or is_loopback_host(host):
        return
    raise ConfigError(
        f"HYATLAS_GO_HOST={host!r} is not a loopback address: set HYATLAS_TOKEN or "
        "HYATLAS_TOKENS_FILE so that the API is not open to the network"
    )


def _mmr_lambda(env: Mapping[str, str]) -> float:
    value = read_float(env, "HYATLAS_MMR_LAMBDA", 0.75, 0.0, 1.0)
    if value <= 0:
        raise ConfigError(f"HYATLAS_MMR_LAMBDA={value!r} must be in (0, 1]")
    return value


def _read_timeout(env: Mapping[str, str], name: str, default: float) -> float:
    """A duration that must stay on: a slow client is never given unlimited time."""
    value = read_duration(env, name, default)
    if value is None:
        raise ConfigError(f"{name}={env.get(name, '')!r} must be a positive duration")
    return value
