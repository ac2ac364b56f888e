"""The store's PostgreSQL schema: the SQLite tables' columns, with pgvector and full-text search.

Tables and columns keep the SQLite names (services/store/schema.py), so the rows, audit and
graph mean the same on both backends. What differs:
- times are double precision (SQLite's REAL is eight bytes too);
- vectors are halfvec(ndim) columns beside their rows, with an HNSW index (cosine) on each
  vector table; the usearch files of the SQLite store have no counterpart here;
- the keyword index is a generated tsvector column (TEXT_CONFIG: the text split into words,
  accents folded and Snowball English stems, as the SQLite store's tantivy index makes its terms
  and the query side stems with PyStemmer's English) under a GIN index that leads with the owner
  (btree_gin), so a search reads its owner's postings only;
- every vector row carries its owner (user_id) for the same reason.
"""

from __future__ import annotations

import time
import uuid

import asyncpg

from services.store.model import LINE_IDS_STATE
from shared.errors import ConfigError
from shared.text import edge_key

REEMBED_INSTEAD = (
    "run the new model on a new database and copy this one into it with `hyatlas migrate "
    "--to` (its import embeds every row and key again with the new model)"
)
"""How a store on PostgreSQL moves to another embedding model meanwhile."""

SCHEMA_VERSION = 7
"""1: the first; 2: the session neighbours index without agent_id; 3: GIN pending lists of
GIN_PENDING_KB; 4: memory_keys_context_owner; 5: graph_edges' name keys (the SQLite store's
version 4); 6: the keyword columns made with TEXT_CONFIG from the text split at punctuation;
7: memories.utc_offset_minutes, the writer's UTC offset (the SQLite store's version 5)."""

GIN_PENDING_KB = 128
"""The most a GIN index keeps of new rows in its pending list before merging them in (the
server's default is 4 MB). Every keyword search reads the whole list: with 4,894 rows waiting
there at 20,000 memories it cost a search more than the rest of its keyword work. At 128 kB,
loading those 20,000 rows took 6.5 s against 5.7 s (README)."""

TEXT_CONFIG = "hyatlas"
"""The text search configuration of the keyword columns and of each query term: English as
PostgreSQL has it, but accents folded (unaccent) and no stop words, as the SQLite store's tantivy
analyzer (the query side leaves its own stop words out, on both backends)."""

_TEXT_CONFIG_SQL = f"""
CREATE EXTENSION IF NOT EXISTS unaccent;
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_ts_dict WHERE dictname = '{TEXT_CONFIG}_stem') THEN
    CREATE TEXT SEARCH DICTIONARY {TEXT_CONFIG}_stem (TEMPLATE = snowball, LANGUAGE = english);
  END IF;
  IF NOT EXISTS (SELECT FROM pg_ts_config WHERE cfgname = '{TEXT_CONFIG}') THEN
    CREATE TEXT SEARCH CONFIGURATION {TEXT_CONFIG} (COPY = english);
    ALTER TEXT SEARCH CONFIGURATION {TEXT_CONFIG}
      ALTER MAPPING FOR asciiword, word, asciihword, hword, hword_asciipart, hword_part
      WITH unaccent, {TEXT_CONFIG}_stem;
    ALTER TEXT SEARCH CONFIGURATION {TEXT_CONFIG}
      ALTER MAPPING FOR numword, numhword, hword_numpart WITH unaccent, simple;
  END IF;
END $$;
"""


def _terms(text: str) -> str:
    """The tsvector of a text column. Punctuation becomes a space first: PostgreSQL's parser
    keeps an e-mail address, a URL or a decimal as one token, where tantivy and the query side
    split them into words."""
    return f"to_tsvector('{TEXT_CONFIG}', regexp_replace({text}, '[[:punct:]]+', ' ', 'g'))"


_TERM_COLUMNS = {
    "memories": f"content_terms TSVECTOR GENERATED ALWAYS AS ({_terms('content')}) STORED",
    "memory_keys": "text_terms TSVECTOR GENERATED ALWAYS AS ("
    f"CASE WHEN kind = 'context' THEN {_terms('text')} END) STORED",
}
"""The keyword column of each table that has one."""

_GIN_SQL = {
    "memories_terms": "CREATE INDEX IF NOT EXISTS memories_terms "
    "ON memories USING gin (user_id, content_terms) "
    f"WITH (gin_pending_list_limit = {GIN_PENDING_KB})",
    "memory_keys_terms": "CREATE INDEX IF NOT EXISTS memory_keys_terms "
    "ON memory_keys USING gin (user_id, text_terms) "
    f"WITH (gin_pending_list_limit = {GIN_PENDING_KB}) WHERE kind = 'context'",
}
"""The GIN indexes of the keyword columns, by name."""

_GIN_INDEXES = tuple(_GIN_SQL)

# The project's advisory lock ids.
SCHEMA_LOCK = 0x4859_0001
"""Held while the schema is created or migrated, so replicas starting together do not race."""
WRITE_LOCK = 0x4859_0002
"""Held by every write transaction: writes of all replicas are applied one at a time, as the
SQLite store's single writer does, so per-owner order and read-your-write hold across them. A
replica's start holds it too while its statements lock the tables (in their own order, which
a write's could cross: a deadlock)."""


def _tables(ndim: int) -> str:
    return f"""
CREATE EXTENSION IF NOT EXISTS vector;
CREATE EXTENSION IF NOT EXISTS btree_gin;
{_TEXT_CONFIG_SQL}
CREATE TABLE IF NOT EXISTS schema_version (
  version INTEGER NOT NULL,
  applied_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS store_meta (
  key TEXT PRIMARY KEY,
  value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS memories (
  seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
  id TEXT NOT NULL UNIQUE,
  user_id TEXT NOT NULL,
  agent_id TEXT NOT NULL DEFAULT '',
  session_id TEXT NOT NULL DEFAULT '',
  layer TEXT NOT NULL,
  content TEXT NOT NULL,
  label TEXT NOT NULL DEFAULT '',
  count INTEGER NOT NULL DEFAULT 0,
  hits INTEGER NOT NULL DEFAULT 0,
  source_ids TEXT NOT NULL DEFAULT '[]',
  metadata TEXT NOT NULL DEFAULT '{{}}',
  model_id TEXT NOT NULL DEFAULT '',
  created_at DOUBLE PRECISION NOT NULL,
  updated_at DOUBLE PRECISION NOT NULL,
  event_at DOUBLE PRECISION,
  valid_to DOUBLE PRECISION,
  due_at DOUBLE PRECISION,
  status TEXT NOT NULL DEFAULT 'active',
  invalid_at DOUBLE PRECISION,
  superseded_by TEXT NOT NULL DEFAULT '',
  superseded_how TEXT NOT NULL DEFAULT '',
  drop_reason TEXT NOT NULL DEFAULT '',
  retired_by TEXT NOT NULL DEFAULT '',
  pass_id TEXT NOT NULL DEFAULT '',
  extraction_status TEXT NOT NULL DEFAULT '',
  extraction_tries INTEGER NOT NULL DEFAULT 0,
  write_mode TEXT NOT NULL DEFAULT '',
  utc_offset_minutes INTEGER NOT NULL DEFAULT 0,
  {_TERM_COLUMNS["memories"]}
);
CREATE INDEX IF NOT EXISTS memories_owner
  ON memories(user_id, agent_id, layer, status, created_at);
CREATE INDEX IF NOT EXISTS memories_extraction ON memories(extraction_status);
CREATE INDEX IF NOT EXISTS memories_created ON memories(created_at);
CREATE INDEX IF NOT EXISTS memories_superseded_by ON memories(superseded_by)
  WHERE superseded_by != '';
-- A turn's neighbours in its session. Not by agent_id as well: three names of up to 256
-- characters (1 KiB of UTF-8 each) would not fit one index entry (version 1 had it).
DROP INDEX IF EXISTS memories_neighbours;
CREATE INDEX IF NOT EXISTS memories_session_turns
  ON memories(user_id, session_id, layer, seq);
{_GIN_SQL["memories_terms"]};

CREATE TABLE IF NOT EXISTS vectors (
  key BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
  memory_id TEXT NOT NULL UNIQUE REFERENCES memories(id) ON DELETE CASCADE,
  user_id TEXT NOT NULL,
  model_id TEXT NOT NULL,
  vector HALFVEC({ndim}) NOT NULL
);
CREATE INDEX IF NOT EXISTS vectors_owner ON vectors(user_id);

CREATE TABLE IF NOT EXISTS audit (
  seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
  at DOUBLE PRECISION NOT NULL,
  actor TEXT NOT NULL,
  action TEXT NOT NULL,
  memory_id TEXT NOT NULL,
  user_id TEXT NOT NULL,
  agent_id TEXT NOT NULL,
  before_json TEXT NOT NULL DEFAULT '',
  after_json TEXT NOT NULL DEFAULT '',
  reason TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS audit_memory ON audit(memory_id, seq);
-- A restore reads what earlier restores of its owner's rows found (apply._restored_over).
CREATE INDEX IF NOT EXISTS audit_restores ON audit(user_id, seq) WHERE action = 'restore';

-- Extra search keys that point back to a memory: context (keyword only) and clause (a
-- sentence of a long memory, with a vector).
CREATE TABLE IF NOT EXISTS memory_keys (
  key BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
  memory_id TEXT NOT NULL REFERENCES memories(id) ON DELETE CASCADE,
  user_id TEXT NOT NULL,
  kind TEXT NOT NULL,
  text TEXT NOT NULL,
  model_id TEXT NOT NULL DEFAULT '',
  vector HALFVEC({ndim}),
  {_TERM_COLUMNS["memory_keys"]}
);
CREATE INDEX IF NOT EXISTS memory_keys_memory ON memory_keys(memory_id, kind);
CREATE INDEX IF NOT EXISTS memory_keys_owner ON memory_keys(user_id) WHERE vector IS NOT NULL;
{_GIN_SQL["memory_keys_terms"]};
-- An owner's context keys counted from the index alone (pg/text.py's idf weights), where the
-- GIN index's count reads every key's row: 1.5 GB at 1,000,000 keys.
CREATE INDEX IF NOT EXISTS memory_keys_context_owner ON memory_keys(user_id)
  WHERE kind = 'context';

CREATE TABLE IF NOT EXISTS graph_edges (
  seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
  id TEXT NOT NULL UNIQUE,
  user_id TEXT NOT NULL,
  agent_id TEXT NOT NULL DEFAULT '',
  subject TEXT NOT NULL,
  relation TEXT NOT NULL,
  object TEXT NOT NULL,
  weight DOUBLE PRECISION NOT NULL DEFAULT 1.0,
  source_ids TEXT NOT NULL DEFAULT '[]',
  fact_ids TEXT NOT NULL DEFAULT '[]',
  memory_id TEXT NOT NULL DEFAULT '',
  recorded_at DOUBLE PRECISION NOT NULL,
  invalidated_at DOUBLE PRECISION,
  valid_from DOUBLE PRECISION,
  valid_to DOUBLE PRECISION,
  stale INTEGER NOT NULL DEFAULT 0,
  undone INTEGER NOT NULL DEFAULT 0,
  pass_id TEXT NOT NULL DEFAULT '',
  subject_key TEXT NOT NULL,
  relation_key TEXT NOT NULL,
  object_key TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS graph_edges_owner ON graph_edges(user_id, agent_id, recorded_at);
CREATE INDEX IF NOT EXISTS graph_edges_memory ON graph_edges(memory_id);

CREATE TABLE IF NOT EXISTS service_state (
  key TEXT PRIMARY KEY,
  value TEXT NOT NULL,
  updated_at DOUBLE PRECISION NOT NULL
);

CREATE TABLE IF NOT EXISTS pass_changes (
  seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
  pass_id TEXT NOT NULL,
  kind TEXT NOT NULL,
  target_id TEXT NOT NULL,
  before_json TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS pass_changes_pass ON pass_changes(pass_id, seq);

CREATE TABLE IF NOT EXISTS idempotency_keys (
  user_id TEXT NOT NULL,
  agent_id TEXT NOT NULL,
  key TEXT NOT NULL,
  request_hash TEXT NOT NULL,
  memory_ids TEXT NOT NULL,
  created_at DOUBLE PRECISION NOT NULL,
  PRIMARY KEY (user_id, agent_id, key)
);
CREATE INDEX IF NOT EXISTS idempotency_keys_created ON idempotency_keys(created_at);
"""


HNSW_INDEXES = {
    "vectors_hnsw": "CREATE INDEX IF NOT EXISTS vectors_hnsw ON vectors "
    "USING hnsw (vector halfvec_cosine_ops)",
    "memory_keys_hnsw": "CREATE INDEX IF NOT EXISTS memory_keys_hnsw ON memory_keys "
    "USING hnsw (vector halfvec_cosine_ops) WHERE vector IS NOT NULL",
}
"""The vector tables' HNSW indexes (cosine) by name; a bulk load may defer them (pg/indexes.py)."""

HNSW_DEFERRED = "hnsw_deferred"
"""The store_meta key present while the HNSW indexes are deferred: a start does not build them."""


async def lock_schema(conn: asyncpg.Connection) -> None:
    """Takes SCHEMA_LOCK, then WRITE_LOCK, till the end of conn's transaction: for statements
    that change the schema (writes wait meanwhile)."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK)
    await conn.execute("SELECT pg_advisory_xact_lock($1)", WRITE_LOCK)


async def create_or_migrate(conn: asyncpg.Connection, ndim: int, where: str) -> None:
    """Creates a new database's schema for ndim-wide vectors, or checks an existing one; one
    replica at a time (an advisory lock), in one transaction."""
    async with conn.transaction():
        await lock_schema(conn)
        version = await _version(conn)
        if version is not None and version > SCHEMA_VERSION:
            raise ConfigError(
                f"{where} has schema version {version}; this build knows up to {SCHEMA_VERSION}"
            )
        stored = await _ndim(conn) if version is not None else None
        if stored is not None and stored != ndim:
            raise ConfigError(
                f"{where} holds {stored}-d vectors but the embedder's model gives {ndim}-d; "
                f"a re-embed is not built for the PostgreSQL store yet: {REEMBED_INSTEAD}"
            )
        await conn.execute(_tables(ndim))
        await conn.execute(
            "INSERT INTO service_state (key, value, updated_at) VALUES ($1, $2, $3) "
            "ON CONFLICT (key) DO NOTHING",
            LINE_IDS_STATE, f'"{uuid.uuid4()}"', time.time(),
        )
        if version is not None and version < 7:
            # Rows written before kept no writer's offset: they are read in UTC days, as they were.
            await conn.execute(
                "ALTER TABLE memories ADD COLUMN IF NOT EXISTS "
                "utc_offset_minutes INTEGER NOT NULL DEFAULT 0"
            )
        if version is not None and version < 3:
            await _bound_gin_pending_lists(conn)
        if version is not None and version < 5:
            await _key_edges(conn)
        if version is not None and version < 6:
            await _remake_term_columns(conn)
        if not await hnsw_deferred(conn):
            for create in HNSW_INDEXES.values():
                await conn.execute(create)
        if version != SCHEMA_VERSION:
            await conn.execute(
                "INSERT INTO schema_version (version, applied_at) VALUES ($1, $2)",
                SCHEMA_VERSION,
                time.time(),
            )


async def _bound_gin_pending_lists(conn: asyncpg.Connection) -> None:
    """Version 3: the GIN indexes' pending lists bounded, and what they hold merged in now."""
    for name in _GIN_INDEXES:
        await conn.execute(f"ALTER INDEX {name} SET (gin_pending_list_limit = {GIN_PENDING_KB})")
        await conn.execute("SELECT gin_clean_pending_list($1::regclass)", name)


async def _key_edges(conn: asyncpg.Connection) -> None:
    """Version 5: each edge's name keys, from its names (lower() compared them before, by the
    database's locale)."""
    for column in ("subject_key", "relation_key", "object_key"):
        await conn.execute(
            f"ALTER TABLE graph_edges ADD COLUMN IF NOT EXISTS {column} TEXT NOT NULL DEFAULT ''"
        )
    edges = await conn.fetch("SELECT seq, subject, relation, object FROM graph_edges")
    await conn.executemany(
        "UPDATE graph_edges SET subject_key = $1, relation_key = $2, object_key = $3 "
        "WHERE seq = $4",
        [(*edge_key(e["subject"], e["relation"], e["object"]), e["seq"]) for e in edges],
    )
    for column in ("subject_key", "relation_key", "object_key"):
        await conn.execute(f"ALTER TABLE graph_edges ALTER COLUMN {column} DROP DEFAULT")


async def _remake_term_columns(conn: asyncpg.Connection) -> None:
    """Version 6: the keyword columns made again with TEXT_CONFIG from the text split at
    punctuation (rewrites both tables), and their GIN indexes built again."""
    for table, column in _TERM_COLUMNS.items():
        name = column.split()[0]
        await conn.execute(f"ALTER TABLE {table} DROP COLUMN {name}")  # and its GIN index
        await conn.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
    for create in _GIN_SQL.values():
        await conn.execute(create)


async def _version(conn: asyncpg.Connection) -> int | None:
    exists = await conn.fetchval("SELECT to_regclass('schema_version') IS NOT NULL")
    if not exists:
        return None
    value = await conn.fetchval("SELECT max(version) FROM schema_version")
    return int(value) if value is not None else None


async def _ndim(conn: asyncpg.Connection) -> int | None:
    """The width of the vectors column (atttypmod of a halfvec is its dimension count)."""
    value = await conn.fetchval(
        "SELECT atttypmod FROM pg_attribute WHERE attrelid = 'vectors'::regclass "
        "AND attname = 'vector'"
    )
    return int(value) if value is not None and value > 0 else None


async def hnsw_deferred(conn: asyncpg.Connection) -> bool:
    """Whether the HNSW indexes are deferred (the schema exists)."""
    value = await conn.fetchval("SELECT value FROM store_meta WHERE key = $1", HNSW_DEFERRED)
    return value is not None
