"""Fixtures: one embedder process for the session, stacks of services per test or module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ServiceProcess, base_env, grpc_serving


@pytest.fixture(scope="session")
def embedder_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The address of one real embedder process (the ONNX model) shared by the session."""
    run_dir: Path = tmp_path_factory.mktemp("embedder")
    address = f"unix:{run_dir / 'embedder.sock'}"
    env = base_env(run_dir, HYATLAS_EMBEDDER_ADDR=address)
    proc = ServiceProcess(
        "services.embedder", env, lambda: grpc_serving(address), run_dir / "embedder.log"
    ).start()
    yield address
    proc.stop()
