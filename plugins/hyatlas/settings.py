"""The plugin's settings: one precedence order, the setup schema, and the non-secret config file."""

from __future__ import annotations

import json
import math
import os
import shlex
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

CONFIG_FILE = "hyatlas.json"
"""Non-secret settings written by `hermes memory setup`, under $HERMES_HOME."""

STATE_DIR = "hyatlas"
"""The plugin's own state folder under $HERMES_HOME (outbox, pid file, lock, server log)."""

SECRET_KEYS = frozenset({"llm_key", "token"})
"""Settings that live only in $HERMES_HOME/.env (through their env_var), never in JSON."""

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True)
class PluginSettings:
    """Everything the plugin reads from defaults, hyatlas.json, config.yaml and HYATLAS_* env."""

    server_url: str = "http://127.0.0.1:19528"
    """HYATLAS_SERVER_URL: the gateway's base URL."""
    user_id: str = ""
    """HYATLAS_USER_ID: whose memories these are (see resolve_ids for when it is empty)."""
    agent_id: str = ""
    """HYATLAS_AGENT_ID: which agent writes (see resolve_ids for when it is empty)."""
    auto_start: bool = False
    """HYATLAS_AUTO_START: start the server when the gateway does not answer."""
    server_command: str = "make run"
    """HYATLAS_SERVER_COMMAND: how to start every service (the repository's `make run`)."""
    server_cwd: str = ""
    """HYATLAS_SERVER_CWD: the folder server_command runs in (the repository root)."""
    data_dir: str = ""
    """HYATLAS_GO_DATA: the server's data directory (empty: the server's default)."""
    mode: str = ""
    """HYATLAS_MODE: lite, pro or ultra for an auto-started server (empty: the server's default)."""
    sync: str = ""
    """HYATLAS_SYNC_EXTRACT: on or off, whether a write waits for extraction (empty: default)."""
    llm_base: str = ""
    """HYATLAS_LLM_BASE: the OpenAI-compatible endpoint extraction uses."""
    llm_model: str = ""
    """HYATLAS_LLM_MODEL: the extraction model."""
    llm_key: str = ""
    """HYATLAS_LLM_KEY: the extraction key (secret: $HERMES_HOME/.env only)."""
    token: str = ""
    """HYATLAS_TOKEN: bearer token for a server started with one (secret: .env only)."""
    timeout_s: float = 10.0
    """HYATLAS_TIMEOUT_S: the longest one request to the gateway may take."""
    prefetch_budget_s: float = 3.0
    """HYATLAS_PREFETCH_BUDGET_S: how long prefetch waits for a live search (Hermes cuts at 8 s)."""
    prefetch_limit: int = 8
    """HYATLAS_PREFETCH_LIMIT: how many memories recall asks for."""
    start_timeout_s: float = 60.0
    """HYATLAS_START_TIMEOUT_S: how long an auto start waits for the gateway to answer."""
    backoff_s: float = 30.0
    """HYATLAS_BACKOFF_S: how long recall is skipped after the server failed or timed out."""

    def command_argv(self) -> list[str]:
        """server_command split like a shell would, without running a shell."""
        return shlex.split(self.server_command)


ENV_NAMES: Mapping[str, str] = {
    "server_url": "HYATLAS_SERVER_URL",
    "user_id": "HYATLAS_USER_ID",
    "agent_id": "HYATLAS_AGENT_ID",
    "auto_start": "HYATLAS_AUTO_START",
    "server_command": "HYATLAS_SERVER_COMMAND",
    "server_cwd": "HYATLAS_SERVER_CWD",
    "data_dir": "HYATLAS_GO_DATA",
    "mode": "HYATLAS_MODE",
    "sync": "HYATLAS_SYNC_EXTRACT",
    "llm_base": "HYATLAS_LLM_BASE",
    "llm_model": "HYATLAS_LLM_MODEL",
    "llm_key": "HYATLAS_LLM_KEY",
    "token": "HYATLAS_TOKEN",
    "timeout_s": "HYATLAS_TIMEOUT_S",
    "prefetch_budget_s": "HYATLAS_PREFETCH_BUDGET_S",
    "prefetch_limit": "HYATLAS_PREFETCH_LIMIT",
    "start_timeout_s": "HYATLAS_START_TIMEOUT_S",
    "backoff_s": "HYATLAS_BACKOFF_S",
}
"""The environment variable that overrides each setting."""

POSITIVE = frozenset({"timeout_s", "prefetch_budget_s", "start_timeout_s", "prefetch_limit"})
"""Settings that must be a finite number above 0: a zero timeout fails every call, and a
negative one raises in the thread that waits with it."""

MODES = ("", "lite", "pro", "ultra")
SYNC_VALUES = ("", "on", "off")
SERVER_DEFAULT = "server default"
"""The setup choice that leaves a setting to the server (saved as no value at all)."""


def config_schema() -> list[dict[str, Any]]:
    """The fields `hermes memory setup` asks for, in order."""
    return [
        {"key": "server_url", "description": "HyAtlas gateway URL",
         "default": PluginSettings.server_url},
        {"key": "user_id",
         "description": "User id for memories (blank: Hermes's gateway user, else default)"},
        {"key": "agent_id",
         "description": "Agent id for memories (blank: the Hermes profile name)"},
        {"key": "auto_start", "description": "Start the server when it does not answer",
         "choices": ["false", "true"], "default": "false"},
        {"key": "server_command", "description": "Command that starts the server",
         "default": PluginSettings.server_command},
        {"key": "server_cwd", "description": "Folder the command runs in (the HyAtlas repository)"},
        {"key": "data_dir", "description": "Server data directory (blank: server default)"},
        {"key": "mode",
         "description": "Mode for a started server (lite: store and search only; pro: LLM "
                        "extraction; ultra: pro plus consolidation)",
         "choices": [SERVER_DEFAULT, "lite", "pro", "ultra"], "default": SERVER_DEFAULT},
        {"key": "sync", "description": "Writes wait for extraction",
         "choices": [SERVER_DEFAULT, "off", "on"], "default": SERVER_DEFAULT},
        {"key": "llm_base", "description": "LLM base URL (OpenAI-compatible; blank: none)"},
        {"key": "llm_model", "description": "LLM model name"},
        {"key": "llm_key", "description": "LLM API key", "secret": True,
         "env_var": ENV_NAMES["llm_key"]},
        {"key": "token", "description": "Server bearer token (blank: none)", "secret": True,
         "env_var": ENV_NAMES["token"]},
    ]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON object ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _read_hermes_yaml(path: Path) -> dict[str, Any]:
    """The hyatlas sections of Hermes's config.yaml (memory.hyatlas, plugins.hyatlas, ...)."""
    if not path.exists():
        return {}
    import yaml  # Hermes depends on PyYAML; imported late so the rest works without it.

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: not readable YAML ({exc})") from exc
    merged: dict[str, Any] = {}
    if not isinstance(data, dict):
        return merged
    memory = data.get("memory")
    plugins = data.get("plugins")
    entries = plugins.get("entries") if isinstance(plugins, dict) else None
    entry = entries.get("hyatlas") if isinstance(entries, dict) else None
    for section in (
        memory.get("hyatlas") if isinstance(memory, dict) else None,
        plugins.get("hyatlas") if isinstance(plugins, dict) else None,
        entry.get("settings") if isinstance(entry, dict) else None,
    ):
        if isinstance(section, dict):
            merged.update(section)
    return merged


def parse_flag(name: str, raw: Any) -> bool:
    """A yes/no value: a bool, or true/false, on/off, yes/no, 1/0 in any case."""
    word = str(raw).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{name}={raw!r} is not one of true/false/on/off/1/0")


def _coerce(name: str, raw: Any, default: Any) -> Any:
    if isinstance(default, bool):
        return parse_flag(name, raw)
    if isinstance(default, int):
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{name}={raw!r} is not an integer") from None
    if isinstance(default, float):
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{name}={raw!r} is not a number") from None
    return str(raw).strip()


def _layer(source: str, values: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """The settings among a file's values, each with where it was read."""
    # Hermes's setup wizard writes the choice "server default" into config.yaml's
    # memory.hyatlas section when there is one: it means no value, as in hyatlas.json.
    return {key: (f"{source}: {key}", value) for key, value in values.items()
            if key in ENV_NAMES and value is not None and value != SERVER_DEFAULT}


def load_settings(
    hermes_home: str | Path, environ: Mapping[str, str] | None = None
) -> PluginSettings:
    """Settings from defaults < hyatlas.json < config.yaml (hyatlas sections) < HYATLAS_* env;
    ValueError naming the first value (or file) that is not valid."""
    settings, problems, _ = read_settings(hermes_home, environ)
    if problems:
        raise ValueError(problems[0])
    return settings


class SettingsRead(NamedTuple):
    """What read_settings found."""

    settings: PluginSettings
    """Each value that is not valid left at its default, each file not read left out."""
    problems: list[str]
    """What was wrong, in words a user can act on (none when load_settings would succeed)."""
    files_read: bool
    """Whether every config file was read (else even the ids may not be the configured ones)."""


def read_settings(
    hermes_home: str | Path, environ: Mapping[str, str] | None = None
) -> SettingsRead:
    """The settings load_settings reads, as far as they can be read (see SettingsRead)."""
    environ = os.environ if environ is None else environ
    home = Path(hermes_home)
    layered: dict[str, tuple[str, Any]] = {}
    problems = []
    for path, read in ((home / CONFIG_FILE, _read_json), (home / "config.yaml", _read_hermes_yaml)):
        try:
            layered.update(_layer(str(path), read(path)))
        except ValueError as exc:
            problems.append(str(exc))
    for key, env_name in ENV_NAMES.items():
        if environ.get(env_name, "") != "":
            layered[key] = (env_name, environ[env_name])
    files_read = not problems
    settings, invalid = _checked(layered)
    return SettingsRead(settings, problems + invalid, files_read)


def _checked(
    layered: Mapping[str, tuple[str, Any]],
) -> tuple[PluginSettings, list[str]]:
    """Settings from (where it was read, raw value) per setting, each value that is not valid
    left at its default; and a ValueError's text for each of those."""
    values: dict[str, Any] = {}
    problems = []
    for f in fields(PluginSettings):
        if f.name in layered:
            label, raw = layered[f.name]
            try:
                values[f.name] = _value(f.name, label, raw)
            except ValueError as exc:
                problems.append(str(exc))
    return PluginSettings(**values), problems


def _value(key: str, label: str, raw: Any) -> Any:
    """One setting's value from its raw value; ValueError naming label when it is not valid."""
    value = _coerce(label, raw, getattr(PluginSettings, key))
    if key in POSITIVE and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{label}={raw!r} must be a number above 0")
    if key == "mode" and value not in MODES:
        raise ValueError(f"mode={value!r} is not one of lite, pro, ultra")
    if key == "sync" and value not in SYNC_VALUES:
        raise ValueError(f"sync={value!r} is not one of on, off")
    if key == "server_url":
        return gateway_url(label, value)
    return value


def check_value(key: str, raw: Any) -> Any:
    """A setup answer for key as the plugin would load it; ValueError saying why not."""
    return _value(key, key, raw)


def saved_config(hermes_home: str | Path) -> dict[str, Any]:
    """What $HERMES_HOME/hyatlas.json holds ({} without one)."""
    return _read_json(Path(hermes_home) / CONFIG_FILE)


def gateway_url(label: str, raw: str) -> str:
    """The gateway's base URL: an http(s) URL with a host, or host:port as a user types it
    (taken as http://host:port, the gateway's own scheme); ValueError naming label otherwise."""
    url = raw if "://" in raw else f"http://{raw}"
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError:
        raise ValueError(f"{label}={raw!r} has a port that is not a number") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{label}={raw!r} is not an http(s) URL")
    return url


def save_config(values: Mapping[str, Any], hermes_home: str | Path) -> Path:
    """Merges the non-secret values into $HERMES_HOME/hyatlas.json (mode 0600); drops secrets.
    ValueError, after saving the rest, naming each value that is not valid (not saved)."""
    home = Path(hermes_home)
    home.mkdir(parents=True, exist_ok=True)
    path = home / CONFIG_FILE
    current = _read_json(path)
    refused = []
    for key, value in values.items():
        if key in SECRET_KEYS or key not in ENV_NAMES:
            continue
        if value == SERVER_DEFAULT:
            current.pop(key, None)
            continue
        # A value load_settings would refuse is not saved (it would turn the provider off at
        # the next start), but the other answers of the same setup are.
        try:
            current[key] = _value(key, key, value)
        except ValueError as exc:
            kept = current.get(key, getattr(PluginSettings, key))
            refused.append(f"{exc}; not saved, {key} stays {kept!r}")
    # Write to a private temp file first so the config is never briefly world-readable.
    fd, tmp = tempfile.mkstemp(dir=home, prefix=".hyatlas.", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(current, out, indent=2, sort_keys=True)
            out.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if refused:
        raise ValueError("; ".join(refused) + " (the other answers were saved)")
    return path


def state_dir(hermes_home: str | Path) -> Path:
    """$HERMES_HOME/hyatlas, created on first use; kept 0700, since what it holds (queued
    memories, the server's log) is this user's alone."""
    path = Path(hermes_home) / STATE_DIR
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def private_file(path: Path) -> Path:
    """path, created empty if missing, with mode 0600 whatever the process's umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    return path


def resolve_ids(settings: PluginSettings, hermes_ids: Mapping[str, Any]) -> tuple[str, str]:
    """(user_id, agent_id) for the provider, its tools and the CLI alike.

    Each id is the first non-empty of: the plugin's setting (HYATLAS_* env over the config
    files, see load_settings), then Hermes's own identity (its gateway user id for user_id,
    its profile name for agent_id), then "default". A configured id always wins, so the agent
    and `hermes hyatlas ...` look at the same memories.
    """
    user = settings.user_id or str(hermes_ids.get("user_id") or "") or "default"
    agent = settings.agent_id or str(hermes_ids.get("agent_identity") or "") or "default"
    return user.strip(), agent.strip()


def hermes_home_dir() -> Path:
    """The active HERMES_HOME (Hermes's own resolver, else the env var, else ~/.hermes)."""
    try:
        from hermes_constants import get_hermes_home

        return Path(get_hermes_home())
    except ImportError:
        return Path(os.environ.get("HERMES_HOME") or Path.home() / ".hermes")


def hermes_identity() -> dict[str, str]:
    """Outside a session (CLI, dashboard tab): the profile name Hermes would pass as identity."""
    try:
        from hermes_cli.profiles import get_active_profile_name
    except ImportError:
        return {}
    return {"agent_identity": get_active_profile_name()}
