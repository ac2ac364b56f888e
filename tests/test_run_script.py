"""scripts/run.py's environment for supervisord: how many stores it starts and where they serve."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from shared.errors import ConfigError
from shared.settings import Settings

DSN = "postgresql://u@127.0.0.1/db"


def run_script() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "scripts" / "run.py"
    spec = importlib.util.spec_from_file_location("hyatlas_run_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def store_env(env: dict[str, str]) -> dict[str, str]:
    return run_script().store_replicas(env, Settings.from_env(env))  # type: ignore[no-any-return]


def test_one_store_by_default_on_its_own_address(tmp_path: Path) -> None:
    env = {"HYATLAS_GO_DATA": str(tmp_path)}
    assert store_env(env) == {"HYATLAS_STORE_REPLICAS": "1"}


def test_replicas_get_one_socket_each_in_the_run_dir(tmp_path: Path) -> None:
    env = {
        "HYATLAS_RUN_DIR": str(tmp_path),
        "HYATLAS_STORE_REPLICAS": "2",
        "HYATLAS_STORE_DSN": DSN,
    }
    assert store_env(env) == {
        "HYATLAS_STORE_REPLICAS": "2",
        "HYATLAS_STORE_ADDR": f"unix:{tmp_path / 'store-0.sock'},unix:{tmp_path / 'store-1.sock'}",
    }


def test_replicas_need_postgresql() -> None:
    with pytest.raises(ConfigError, match="HYATLAS_STORE_REPLICAS=2 needs HYATLAS_STORE_DSN"):
        store_env({"HYATLAS_STORE_REPLICAS": "2"})


def test_a_given_address_lists_one_endpoint_per_replica() -> None:
    env = {
        "HYATLAS_STORE_REPLICAS": "3",
        "HYATLAS_STORE_DSN": DSN,
        "HYATLAS_STORE_ADDR": "unix:/run/a.sock,unix:/run/b.sock",
    }
    with pytest.raises(ConfigError, match="must list HYATLAS_STORE_REPLICAS=3 endpoints"):
        store_env(env)


@pytest.mark.parametrize(
    ("mode", "extractor", "consolidator"),
    [("lite", "false", "false"), ("pro", "true", "false"), ("ultra", "true", "true")],
)
def test_a_mode_starts_only_the_services_it_uses(
    mode: str, extractor: str, consolidator: str
) -> None:
    assert run_script().started_services(mode) == {
        "HYATLAS_START_EXTRACTOR": extractor,
        "HYATLAS_START_CONSOLIDATOR": consolidator,
    }
