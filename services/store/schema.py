"""The store's SQLite schema: tables, keyword indexes, and the steps from older versions."""

from __future__ import annotations

import time
import uuid

import aiosqlite

from services.store.model import LINE_IDS_STATE
from shared.errors import ConfigError
from shared.text import edge_key

SCHEMA_VERSION = 5

# Rows and their keys carry an owner key: one token per user id ('o' and the id's hex), indexed
# beside the text, so a keyword search reads only its owner's postings.
_TABLES = """
CREATE TABLE IF NOT EXISTS schema_version (
  version INTEGER NOT NULL,
  applied_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS store_meta (
  key TEXT PRIMARY KEY,
  value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS memories (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
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
  metadata TEXT NOT NULL DEFAULT '{}',
  model_id TEXT NOT NULL DEFAULT '',
  created_at REAL NOT NULL,
  updated_at REAL NOT NULL,
  event_at REAL,
  valid_to REAL,
  due_at REAL,
  status TEXT NOT NULL DEFAULT 'active',
  invalid_at REAL,
  superseded_by TEXT NOT NULL DEFAULT '',
  superseded_how TEXT NOT NULL DEFAULT '',
  drop_reason TEXT NOT NULL DEFAULT '',
  retired_by TEXT NOT NULL DEFAULT '',
  pass_id TEXT NOT NULL DEFAULT '',
  extraction_status TEXT NOT NULL DEFAULT '',
  extraction_tries INTEGER NOT NULL DEFAULT 0,
  write_mode TEXT NOT NULL DEFAULT '',
  utc_offset_minutes INTEGER NOT NULL DEFAULT 0,
  owner_key TEXT GENERATED ALWAYS AS ('o' || hex(user_id)) VIRTUAL
);
CREATE INDEX IF NOT EXISTS memories_owner
  ON memories(user_id, agent_id, layer, status, created_at);
-- A user's rows of a few layers across their agents (memories_owner has agent_id between):
-- a search, list or count of a layer the user holds few rows of reads those rows only.
CREATE INDEX IF NOT EXISTS memories_user_layer ON memories(user_id, layer, status);
CREATE INDEX IF NOT EXISTS memories_extraction ON memories(extraction_status);
CREATE INDEX IF NOT EXISTS memories_created ON memories(created_at);

CREATE TABLE IF NOT EXISTS vectors (
  key INTEGER PRIMARY KEY AUTOINCREMENT,
  memory_id TEXT NOT NULL UNIQUE REFERENCES memories(id) ON DELETE CASCADE,
  model_id TEXT NOT NULL,
  vector BLOB NOT NULL
);

CREATE TABLE IF NOT EXISTS audit (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  at REAL NOT NULL,
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
CREATE INDEX IF NOT EXISTS memories_superseded_by ON memories(superseded_by)
  WHERE superseded_by != '';
CREATE INDEX IF NOT EXISTS memories_neighbours
  ON memories(user_id, agent_id, session_id, layer, seq);

-- Extra search keys that point back to a memory: context (the turn with its neighbours, for
-- keyword search) and clause (a sentence of a long memory, with a vector).
CREATE TABLE IF NOT EXISTS memory_keys (
  key INTEGER PRIMARY KEY AUTOINCREMENT,
  memory_id TEXT NOT NULL REFERENCES memories(id) ON DELETE CASCADE,
  kind TEXT NOT NULL,
  text TEXT NOT NULL,
  model_id TEXT NOT NULL DEFAULT '',
  vector BLOB,
  owner_key TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS memory_keys_memory ON memory_keys(memory_id, kind);
-- Key to memory without reading the rows, which their inline vectors make large: a vector search
-- maps its nearest own keys to memories through it (repo.MEMORIES_OF_KEYS). A sentence key's row
-- is read for its text in any case: the (key, memory_id) index stores kept for them is dropped.
CREATE INDEX IF NOT EXISTS vectors_key_memory ON vectors(key, memory_id);
DROP INDEX IF EXISTS memory_keys_key_memory;
-- Which models the vectors come from, counted at every open (repo.VECTOR_MODELS).
CREATE INDEX IF NOT EXISTS vectors_model ON vectors(model_id);
-- The L5 graph: relations with their evidence and both time axes.
CREATE TABLE IF NOT EXISTS graph_edges (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  user_id TEXT NOT NULL,
  agent_id TEXT NOT NULL DEFAULT '',
  subject TEXT NOT NULL,
  relation TEXT NOT NULL,
  object TEXT NOT NULL,
  weight REAL NOT NULL DEFAULT 1.0,
  source_ids TEXT NOT NULL DEFAULT '[]',
  fact_ids TEXT NOT NULL DEFAULT '[]',
  memory_id TEXT NOT NULL DEFAULT '',
  recorded_at REAL NOT NULL,
  invalidated_at REAL,
  valid_from REAL,
  valid_to REAL,
  stale INTEGER NOT NULL DEFAULT 0,
  undone INTEGER NOT NULL DEFAULT 0,
  pass_id TEXT NOT NULL DEFAULT '',
  -- The names as they are compared (shared.text.edge_key): SQLite's lower() folds ASCII alone.
  subject_key TEXT NOT NULL,
  relation_key TEXT NOT NULL,
  object_key TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS graph_edges_owner ON graph_edges(user_id, agent_id, recorded_at);
CREATE INDEX IF NOT EXISTS graph_edges_memory ON graph_edges(memory_id);

-- Small values other services keep through the store (the consolidator's clusters, schedule).
CREATE TABLE IF NOT EXISTS service_state (
  key TEXT PRIMARY KEY,
  value TEXT NOT NULL,
  updated_at REAL NOT NULL
);

-- What each consolidation pass changed, so one call can revert the whole pass.
CREATE TABLE IF NOT EXISTS pass_changes (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  pass_id TEXT NOT NULL,
  kind TEXT NOT NULL,
  target_id TEXT NOT NULL,
  before_json TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS pass_changes_pass ON pass_changes(pass_id, seq);

-- A re-embed's vectors of the new model, until the switch copies them over: a memory's (with
-- the text it was made from, so a later edit is made again) and its clause keys'.
CREATE TABLE IF NOT EXISTS reembed_vectors (
  memory_id TEXT PRIMARY KEY REFERENCES memories(id) ON DELETE CASCADE,
  content TEXT NOT NULL,
  vector BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS reembed_keys (
  key INTEGER PRIMARY KEY REFERENCES memory_keys(key) ON DELETE CASCADE,
  vector BLOB NOT NULL
);

-- A client's Idempotency-Key per scope: the ids its first write gave and a hash of that write's
-- ops, recorded in the write's own transaction.
CREATE TABLE IF NOT EXISTS idempotency_keys (
  user_id TEXT NOT NULL,
  agent_id TEXT NOT NULL,
  key TEXT NOT NULL,
  request_hash TEXT NOT NULL,
  memory_ids TEXT NOT NULL,
  created_at REAL NOT NULL,
  PRIMARY KEY (user_id, agent_id, key)
);
CREATE INDEX IF NOT EXISTS idempotency_keys_created ON idempotency_keys(created_at);
"""

# Every change to an indexed text is logged beside it, in its transaction: the keyword indexes
# (text_index.py, tantivy folders beside the database) follow the log.
_TEXT_LOG = """
CREATE TABLE IF NOT EXISTS text_changes (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  kind TEXT NOT NULL,
  id INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS memories_text_insert AFTER INSERT ON memories BEGIN
  INSERT INTO text_changes(kind, id) VALUES ('own', new.seq);
END;
CREATE TRIGGER IF NOT EXISTS memories_text_delete AFTER DELETE ON memories BEGIN
  INSERT INTO text_changes(kind, id) VALUES ('own', old.seq);
END;
CREATE TRIGGER IF NOT EXISTS memories_text_update AFTER UPDATE OF content ON memories BEGIN
  INSERT INTO text_changes(kind, id) VALUES ('own', new.seq);
END;

-- Context keys only: clause keys are found by their vectors.
CREATE TRIGGER IF NOT EXISTS memory_keys_text_insert AFTER INSERT ON memory_keys
WHEN new.kind = 'context' BEGIN
  INSERT INTO text_changes(kind, id) VALUES ('context', new.key);
END;
CREATE TRIGGER IF NOT EXISTS memory_keys_text_delete AFTER DELETE ON memory_keys
WHEN old.kind = 'context' BEGIN
  INSERT INTO text_changes(kind, id) VALUES ('context', old.key);
END;
CREATE TRIGGER IF NOT EXISTS memory_keys_text_update AFTER UPDATE OF text ON memory_keys
WHEN old.kind = 'context' BEGIN
  INSERT INTO text_changes(kind, id) VALUES ('context', new.key);
END;
"""

# Version 1 indexed text alone, so every keyword search read every owner's postings.
_FROM_1 = """
ALTER TABLE memories ADD COLUMN owner_key TEXT GENERATED ALWAYS AS ('o' || hex(user_id)) VIRTUAL;
ALTER TABLE memory_keys ADD COLUMN owner_key TEXT NOT NULL DEFAULT '';
UPDATE memory_keys SET owner_key =
  (SELECT m.owner_key FROM memories m WHERE m.id = memory_keys.memory_id);
"""

# Versions 1 to 3 compared edge names with SQL's lower(); _key_edges fills the keys in.
_EDGE_KEYS = """
ALTER TABLE graph_edges ADD COLUMN subject_key TEXT NOT NULL DEFAULT '';
ALTER TABLE graph_edges ADD COLUMN relation_key TEXT NOT NULL DEFAULT '';
ALTER TABLE graph_edges ADD COLUMN object_key TEXT NOT NULL DEFAULT '';
"""

# Versions 1 to 4 kept no writer's UTC offset: their rows are read in UTC days, as they were.
_WRITER_OFFSET = """
ALTER TABLE memories ADD COLUMN utc_offset_minutes INTEGER NOT NULL DEFAULT 0;
"""

# Versions 1 and 2 kept the keyword indexes in FTS5 tables; the store builds the tantivy
# indexes from the rows when it opens (they have no position yet).
_FROM_FTS5 = """
DROP TRIGGER IF EXISTS memories_fts_insert;
DROP TRIGGER IF EXISTS memories_fts_delete;
DROP TRIGGER IF EXISTS memories_fts_update;
DROP TRIGGER IF EXISTS memory_keys_fts_insert;
DROP TRIGGER IF EXISTS memory_keys_fts_delete;
DROP TRIGGER IF EXISTS memory_keys_fts_update;
DROP TABLE IF EXISTS memories_fts;
DROP TABLE IF EXISTS memory_keys_fts;
"""


async def create_or_migrate(conn: aiosqlite.Connection, path: object) -> None:
    """Creates a new database's schema, or brings an older one up to SCHEMA_VERSION."""
    version = await _version(conn)
    if version is not None and version > SCHEMA_VERSION:
        raise ConfigError(
            f"{path} has schema version {version}; this build knows up to {SCHEMA_VERSION}"
        )
    if version is not None and version < SCHEMA_VERSION:
        # One transaction: a crash mid-way leaves the older version as it was.
        steps = (_FROM_1 if version == 1 else "") + (_FROM_FTS5 if version < 3 else "")
        if version < 4:
            steps += _EDGE_KEYS + _TEXT_LOG
        await conn.executescript(f"BEGIN IMMEDIATE; {steps} {_WRITER_OFFSET}")
        if version < 4:
            await _key_edges(conn)
        await _set_version(conn)
        await conn.execute("COMMIT")
    # Also after a migration: tables added since without a version step reach every store.
    await conn.executescript(_TABLES + _TEXT_LOG)
    await conn.execute(
        "INSERT OR IGNORE INTO service_state (key, value, updated_at) VALUES (?, ?, ?)",
        (LINE_IDS_STATE, f'"{uuid.uuid4()}"', time.time()),
    )
    if version is None:
        await _set_version(conn)


async def _key_edges(conn: aiosqlite.Connection) -> None:
    """Version 4: each edge's name keys, from its names."""
    edges = await conn.execute_fetchall("SELECT seq, subject, relation, object FROM graph_edges")
    await conn.executemany(
        "UPDATE graph_edges SET subject_key = ?, relation_key = ?, object_key = ? WHERE seq = ?",
        [(*edge_key(subject, relation, obj), seq) for seq, subject, relation, obj in edges],
    )


async def _version(conn: aiosqlite.Connection) -> int | None:
    tables = await conn.execute_fetchall(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    )
    if not tables:
        return None
    rows = list(await conn.execute_fetchall("SELECT max(version) FROM schema_version"))
    return rows[0][0]


async def _set_version(conn: aiosqlite.Connection) -> None:
    await conn.execute(
        "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)",
        (SCHEMA_VERSION, time.time()),
    )
