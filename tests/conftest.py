"""Fixtures: one embedder process for the session, stacks of services per test or module, and
the store backend each test module runs on."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import ServiceProcess, StoreBackend, base_env, grpc_serving

# The suites that run once on each store backend: SQLite, then PostgreSQL with pgvector. A
# module-scoped fixture of theirs that starts services (or scripts an LLM for them) takes
# store_backend, so each backend gets its own: otherwise pytest keeps the first one for both.
BOTH_BACKENDS = frozenset(
    {
        "test_consolidator",
        "test_consolidator_cross",
        "test_consolidator_pages",
        "test_consolidator_store",
        "test_extractor",
        "test_extractor_catchup",
        "test_extractor_living",
        "test_idempotency",
        "test_leases",
        "test_lite_mode",
        "test_replica_turns",
        "test_search_first_person",
        "test_search_graph",
        "test_search_recall",
        "test_search_service",
        "test_store",
        "test_transfer",
    }
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Runs every test of a BOTH_BACKENDS module on each backend, module by module."""
    if metafunc.module.__name__.rsplit(".", 1)[-1] in BOTH_BACKENDS:
        only_sqlite = metafunc.definition.get_closest_marker("sqlite_only") is not None
        backends = ["sqlite"] if only_sqlite else ["sqlite", "postgres"]
        metafunc.parametrize("store_backend", backends, indirect=True, scope="module")


@contextlib.contextmanager
def postgres_server() -> Iterator[Any]:
    """A real PostgreSQL server (with pgvector) of its own (bench.postgres.Databases).

    Its folder is not under pytest's temp dir: run as root, the server runs as a user of its
    own, and another pytest session starting meanwhile makes pytest's dir private again.
    """
    from bench.postgres import Databases

    folder = Path(tempfile.mkdtemp(prefix="hyatlas-test-pg-"))
    folder.chmod(0o755)
    databases = Databases(folder / "data")
    try:
        yield databases
    finally:
        databases.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_databases() -> Iterator[object]:
    """One real PostgreSQL server for the session, started on first use."""
    with postgres_server() as databases:
        yield databases


@pytest.fixture(scope="module", autouse=True)
def store_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """The backend the module's stores run on: "sqlite" unless the module is parametrized."""
    backend = getattr(request, "param", "sqlite")
    StoreBackend.databases = (
        request.getfixturevalue("pg_databases") if backend == "postgres" else None
    )
    yield backend
    StoreBackend.databases = None


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
