"""A real PostgreSQL with pgvector for the tests: the server of bench/postgres.py, started once
for the session, and a new empty database for each store a test opens."""

from __future__ import annotations

from bench.postgres import BACKENDS
from bench.postgres import Databases as TestDatabases

__all__ = ["BACKENDS", "TestDatabases"]
