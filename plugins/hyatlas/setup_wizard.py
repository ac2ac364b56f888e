"""`hermes memory setup`: each answer is checked when it is given; saved only when all are."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from .settings import check_value, config_schema, save_config, saved_config

TRIES = 3
"""How often a question is asked before setup gives up (piped answers may run out)."""


class Cancelled(Exception):
    """The user cancelled setup, or gave no valid answer to a question."""


def run_setup(hermes_home: str, config: dict[str, Any]) -> None:
    """Asks every setup question with Hermes's own prompts (a value the plugin could not load
    is asked again), then saves hyatlas.json, the secrets to $HERMES_HOME/.env and
    memory.provider in config.yaml; says saved only once all of it is."""
    from hermes_cli import memory_setup as ui

    current = saved_config(hermes_home)
    print("\n  Configuring hyatlas:\n")
    try:
        answers, secrets = _answers(ui, current)
    except Cancelled as exc:
        print(f"\n  {exc}. Nothing was saved.\n")
        return
    try:
        path = _save(ui, hermes_home, config, answers, secrets)
    except (OSError, ValueError) as exc:
        print(f"\n  Not saved: {exc}\n")
        return
    print("\n  Memory provider: hyatlas (activation saved to config.yaml)")
    print(f"  Settings saved to {path}" + ("; secrets to .env" if secrets else ""))
    print("\n  Start a new session to activate.\n")


def _answers(ui: ModuleType, current: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The answer to each question of the schema, and the secrets by their env var."""
    answers: dict[str, Any] = {}
    secrets: dict[str, str] = {}
    for field in config_schema():
        key = field["key"]
        if field.get("secret"):
            kept = " (set; blank: keep it)" if os.environ.get(field["env_var"]) else ""
            value = ui._prompt(field["description"] + kept, secret=True).strip()
            if value:
                secrets[field["env_var"]] = value
        elif field.get("choices"):
            answers[key] = _choose(ui, field, current)
        else:
            value = _ask(ui, field, current)
            if value:
                answers[key] = value
    return answers, secrets


def _ask(ui: ModuleType, field: dict[str, Any], current: dict[str, Any]) -> str:
    """A text answer, asked again while the plugin could not load it."""
    key = field["key"]
    default = str(current.get(key) or field.get("default") or "")
    for _ in range(TRIES):
        value = ui._prompt(field["description"], default=default or None).strip()
        if not value:
            return ""
        try:
            return str(check_value(key, value))
        except ValueError as exc:
            print(f"  {exc}; try again")
    raise Cancelled(f"no valid {key} after {TRIES} tries")


def _choose(ui: ModuleType, field: dict[str, Any], current: dict[str, Any]) -> str:
    """One of the field's choices: Hermes's picker; piped answers keep the current one."""
    choices = field["choices"]
    now = str(current.get(field["key"], field.get("default") or choices[0])).lower()
    index = choices.index(now) if now in choices else 0
    if not sys.stdin.isatty():  # Hermes's picker cancels without a terminal
        return str(choices[index])
    picked = ui._curses_select(f"  {field['description']}", [(c, "") for c in choices],
                               default=index, cancel_returns=ui._CANCELLED)
    if picked == ui._CANCELLED:
        raise Cancelled("Setup cancelled")
    return str(choices[picked])


def _save(ui: ModuleType, hermes_home: str, config: dict[str, Any], answers: dict[str, Any],
          secrets: dict[str, str]) -> Path:
    from hermes_cli.config import save_config as save_hermes_config

    path = save_config(answers, hermes_home)
    if secrets:
        ui._write_env_vars(Path(hermes_home) / ".env", secrets)
    if not isinstance(config.get("memory"), dict):
        config["memory"] = {}
    config["memory"]["provider"] = "hyatlas"
    save_hermes_config(config)
    return path
