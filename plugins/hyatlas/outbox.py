"""A durable local queue of writes and forgets, sent to the gateway in order by one thread."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .client import ClientError, HttpError, HyAtlasClient, well_formed
from .settings import private_file

log = logging.getLogger("hyatlas.outbox")

PARK_S = 600.0
"""How long a forget waits before it is retried when the server does not offer forget yet."""

KEY_KEPT_S = 24 * 3600.0
"""How long the server remembers an Idempotency-Key (KEPT_S in services/store/idempotency.py)."""

CLOCK_SLACK_S = 3600.0
"""How far this machine's clock and the server's may differ when judging a key's age."""

MAX_OPS = 10_000
"""The most ops an outbox keeps; past it the oldest go, logged and counted as dropped."""

LIST_PAGE = 200
"""Rows per page when looking for a write the server may already hold."""

CONTAINS_CHARS = 256
"""The most characters a list's `contains` takes (MAX_NAME_CHARS in shared/limits.py): the
outbox's lookup and the hyatlas_recent tool keep to it."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS ops (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  kind TEXT NOT NULL,
  payload TEXT NOT NULL,
  created_at REAL NOT NULL,
  attempts INTEGER NOT NULL DEFAULT 0,
  not_before REAL NOT NULL DEFAULT 0,
  dead INTEGER NOT NULL DEFAULT 0,
  last_error TEXT NOT NULL DEFAULT '',
  idempotency_key TEXT NOT NULL DEFAULT ''
)
"""
# How many ops left the outbox without being sent, by reason.
DROPPED_SCHEMA = """
CREATE TABLE IF NOT EXISTS dropped (reason TEXT PRIMARY KEY, ops INTEGER NOT NULL)
"""
# An outbox file from before keys: its ops get one each, kept from then on.
KEYS_ADDED = """
ALTER TABLE ops ADD COLUMN idempotency_key TEXT NOT NULL DEFAULT '';
UPDATE ops SET idempotency_key = lower(hex(randomblob(16)));
"""

SENDERS: dict[str, Callable[[HyAtlasClient, dict[str, Any], str], Any]] = {
    "add": HyAtlasClient.add,
    "forget": lambda client, payload, _key: client.forget(payload),
}


RETRIED_4XX = frozenset({401, 403, 404, 405, 408, 429})
"""4xx answers a later try can change: a token, a timeout, a rate limit, or a route missing
(404/405: server_url reaches another service, or a server without the route, for now)."""


def refused_for_good(exc: HttpError) -> bool:
    """Whether the gateway itself refused an op, so that sending it again cannot help.

    Only its own JSON error counts: a proxy's or another service's 4xx page is retried like a
    server that does not answer.
    """
    return exc.from_gateway and 400 <= exc.status < 500 and exc.status not in RETRIED_4XX


def new_idempotency_key() -> str:
    """A key for one write, unique to it."""
    return uuid.uuid4().hex


def already_stored(client: HyAtlasClient, payload: dict[str, Any], since: float) -> bool:
    """Whether the server holds this add's raw row, written at or after since: the same text,
    agent and session among the owner's raw rows (retired ones too) that hold the text's start,
    newest first (a server without `contains` lists them all, which only takes longer).

    Pages go by the list's cursor, not an offset: rows erased or written while it looks would
    shift an offset past rows it never read.
    """
    wanted = (well_formed(payload.get("text", "")), payload.get("agent_id", ""),
              payload.get("session_id", ""))
    before = ""
    while True:
        listed = client.recent(
            user_id=payload.get("user_id", ""), agent_id=payload.get("agent_id", ""),
            layer="l2_raw", limit=LIST_PAGE, before=before, include_superseded=True,
            contains=wanted[0].split("\x00")[0][:CONTAINS_CHARS],  # a name takes no NUL
        )
        rows = listed.get("memories") or []
        if any((row.get("content"), row.get("agent_id", ""), row.get("session_id", "")) == wanted
               for row in rows):
            return True
        before = listed.get("next_before") or ""
        if not rows or not before or rows[-1].get("gmt_created", 0) < since:
            return False


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction (the connection otherwise commits each statement alone)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _open_db(path: Path) -> sqlite3.Connection:
    # The queue holds memory text: the file is the user's alone, and SQLite gives the -wal and
    # -shm it creates the database file's mode (ones an older version left are tightened too).
    private_file(path)
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(f"{path}{suffix}", 0o600)
    db = sqlite3.connect(path, timeout=10.0, check_same_thread=False, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute(SCHEMA)
        db.execute(DROPPED_SCHEMA)
        columns = {row[1] for row in db.execute("PRAGMA table_info(ops)")}
        if "idempotency_key" not in columns:
            db.executescript(KEYS_ADDED)
    except BaseException:
        db.close()
        raise
    return db


def open_outbox(path: Path, client: HyAtlasClient) -> Outbox:
    """The outbox at path. A file there that is not a readable database is moved aside (kept,
    with its -wal and -shm, as path.corrupt-TIME) and a new outbox is started in its place."""
    try:
        return Outbox(path, client)
    except sqlite3.OperationalError:
        raise  # it could not be opened or written at all: a new file there would fail the same
    except sqlite3.DatabaseError as exc:
        aside = f"{path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
        log.warning("hyatlas outbox %s is not a readable database (%s); moved to %s",
                    path, exc, aside)
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{path}{suffix}", f"{aside}{suffix}")
    return Outbox(path, client)


class Outbox:
    """Ops are committed to SQLite before put() returns and deleted only once the server took them.

    One sender per outbox file across processes (an flock decides who), so two agents sharing a
    HERMES_HOME never send the same op twice.
    """

    def __init__(
        self,
        path: Path,
        client: HyAtlasClient,
        *,
        retry_min_s: float = 0.25,
        retry_max_s: float = 10.0,
        max_ops: int = MAX_OPS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.client = client
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._max_ops = max_ops
        self._clock = clock
        self._db = _open_db(path)
        self._db_lock = threading.Lock()
        self._changed = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sending = False
        """Whether the sender thread runs (guarded by _db_lock)."""
        self._close_when_sent = False
        """close() came while the sender was inside a request: the sender closes the database."""
        self._lock_file = None
        self._failures = 0
        self.last_error = ""
        """The most recent reason a send did not go through ("" after a success)."""

    # -- queue ---------------------------------------------------------------

    def put(self, kind: str, payload: dict[str, Any], idempotency_key: str = "") -> int:
        """Stores one op durably and wakes the sender; returns its id. The op keeps its
        idempotency key (a new one if none is given) through every retry, so the server stores
        a write once however often it is sent."""
        if kind not in SENDERS:
            raise ValueError(f"unknown outbox op {kind!r}")
        key = idempotency_key or new_idempotency_key()
        with self._db_lock, _transaction(self._db):
            cursor = self._db.execute(
                "INSERT INTO ops (kind, payload, created_at, idempotency_key) VALUES (?, ?, ?, ?)",
                (kind, json.dumps(payload), self._clock(), key),
            )
            over = int(self._db.execute("SELECT COUNT(*) FROM ops").fetchone()[0]) - self._max_ops
            if over > 0:
                kinds = self._db.execute(
                    "SELECT kind, COUNT(*) FROM (SELECT kind FROM ops ORDER BY id LIMIT ?)"
                    " GROUP BY kind ORDER BY kind", (over,)
                ).fetchall()
                self._db.execute(
                    "DELETE FROM ops WHERE id IN (SELECT id FROM ops ORDER BY id LIMIT ?)", (over,)
                )
                self._count_dropped("over_limit", over)
        if over > 0:
            log.error("hyatlas outbox holds more than %d writes: the %d oldest were dropped unsent"
                      " (%s)", self._max_ops, over,
                      ", ".join(f"{count} {kind}" for kind, count in kinds))
        self._wake.set()
        return int(cursor.lastrowid or 0)

    def _count_dropped(self, reason: str, ops: int) -> None:
        self._db.execute(
            "INSERT INTO dropped (reason, ops) VALUES (?, ?)"
            " ON CONFLICT(reason) DO UPDATE SET ops = ops + excluded.ops",
            (reason, ops),
        )

    def dropped(self) -> dict[str, int]:
        """How many ops left unsent, by reason: over_limit (the outbox was full, lost) and
        already_stored (queued past the server's key window and found on the server)."""
        with self._db_lock:
            return dict(self._db.execute("SELECT reason, ops FROM dropped ORDER BY reason"))

    def pending(self, kind: str | None = None) -> int:
        """How many ops wait to be sent (parked ones included, refused ones not)."""
        sql = "SELECT COUNT(*) FROM ops WHERE dead = 0"
        args: tuple[Any, ...] = ()
        if kind:
            sql += " AND kind = ?"
            args = (kind,)
        with self._db_lock:
            return int(self._db.execute(sql, args).fetchone()[0])

    def refused(self) -> int:
        """How many ops the gateway refused for good; they stay stored until resend_refused."""
        with self._db_lock:
            return int(self._db.execute("SELECT COUNT(*) FROM ops WHERE dead = 1").fetchone()[0])

    def resend_refused(self) -> int:
        """Puts every refused op back in line, in its old place; returns how many."""
        with self._db_lock:
            cursor = self._db.execute("UPDATE ops SET dead = 0, not_before = 0 WHERE dead = 1")
        self._wake.set()
        return cursor.rowcount

    def snapshot(self) -> list[dict[str, Any]]:
        """Every stored op, oldest first (for status and tests)."""
        with self._db_lock:
            rows = self._db.execute(
                "SELECT id, kind, payload, attempts, not_before, dead, last_error"
                " FROM ops ORDER BY id"
            ).fetchall()
        return [
            {"id": r[0], "kind": r[1], "payload": json.loads(r[2]), "attempts": r[3],
             "parked": r[4] > self._clock(), "dead": bool(r[5]), "last_error": r[6]}
            for r in rows
        ]

    def _next_due(self) -> tuple[int, str, dict[str, Any], str, float] | None:
        with self._db_lock:
            row = self._db.execute(
                "SELECT id, kind, payload, idempotency_key, created_at FROM ops"
                " WHERE dead = 0 AND not_before <= ? ORDER BY id LIMIT 1",
                (self._clock(),),
            ).fetchone()
        return None if row is None else (row[0], row[1], json.loads(row[2]), row[3], row[4])

    def _update(self, sql: str, args: tuple[Any, ...]) -> None:
        with self._db_lock:
            self._db.execute(sql, args)
        with self._changed:
            self._changed.notify_all()

    # -- sending -------------------------------------------------------------

    def send_due(self) -> bool:
        """Sends due ops in order until none is left or the server is unreachable.

        Returns False when it stopped because the server did not take an op for now.
        """
        while not self._stop.is_set():
            item = self._next_due()
            if item is None:
                return True
            op_id, kind, payload, key, created_at = item
            try:
                if self._stored_before(op_id, kind, payload, created_at):
                    continue
                SENDERS[kind](self.client, payload, key)
            except HttpError as exc:
                if kind == "forget" and exc.from_gateway and exc.status in (404, 405, 501):
                    # The gateway has no forget yet: keep it for later without holding up
                    # writes. Another service's 404 is retried in order like a server that is
                    # down: parked, it would come after the writes queued behind it (a replace's
                    # forget of "tea" would then forget its new "green tea" too).
                    log.warning("forget not offered by the server (%s); kept for retry", exc)
                    self._update(
                        "UPDATE ops SET attempts = attempts + 1, not_before = ?, last_error = ?"
                        " WHERE id = ?",
                        (self._clock() + PARK_S, str(exc), op_id),
                    )
                    continue
                if refused_for_good(exc):
                    log.error("gateway refused %s op %d: %s; kept as refused "
                              "(`hermes hyatlas start` sends it again)", kind, op_id, exc)
                    self._update(
                        "UPDATE ops SET attempts = attempts + 1, dead = 1, last_error = ?"
                        " WHERE id = ?",
                        (str(exc), op_id),
                    )
                    continue
                self._note_failure(op_id, exc)
                return False
            except ClientError as exc:
                self._note_failure(op_id, exc)
                return False
            self.last_error = ""
            self._update("DELETE FROM ops WHERE id = ?", (op_id,))
        return False

    def _stored_before(
        self, op_id: int, kind: str, payload: dict[str, Any], created_at: float
    ) -> bool:
        """Whether an add queued longer than the server keeps its key is already stored; if so
        it is dropped, since sending it again under a forgotten key would store it twice."""
        age_s = self._clock() - created_at
        if kind != "add" or age_s < KEY_KEPT_S - CLOCK_SLACK_S:
            return False
        try:
            stored = already_stored(self.client, payload, created_at - CLOCK_SLACK_S)
        except HttpError as exc:
            if not (exc.from_gateway and exc.status in (401, 403)):
                raise
            # A token that may write but not read: sending it again may store it twice, which
            # is better than never sending a write the server may not have.
            log.warning("hyatlas outbox: this token may not list memories (%s); a write "
                        "queued %.1f h ago is sent again unchecked", exc, age_s / 3600)
            return False
        if not stored:
            return False
        log.warning("hyatlas outbox: a write queued %.1f h ago is already stored on the server; "
                    "dropped instead of sent again", age_s / 3600)
        with self._db_lock, _transaction(self._db):
            self._db.execute("DELETE FROM ops WHERE id = ?", (op_id,))
            self._count_dropped("already_stored", 1)
        with self._changed:
            self._changed.notify_all()
        return True

    def send_once(self) -> bool:
        """Sends what is due now from this thread, unless another process holds the sender role."""
        with self._sender_role() as is_sender:
            return is_sender and self.send_due()

    def _note_failure(self, op_id: int, exc: Exception) -> None:
        self._failures += 1
        if self.last_error != str(exc):
            log.warning("hyatlas write kept in the local queue: %s", exc)
        self.last_error = str(exc)
        self._update(
            "UPDATE ops SET attempts = attempts + 1, last_error = ? WHERE id = ?",
            (str(exc), op_id),
        )

    def start(self) -> None:
        """Starts the sender thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="hyatlas-outbox", daemon=True)
        self._sending = True
        self._thread.start()

    def nudge(self) -> None:
        """Makes the sender try again now (e.g. after the server came back)."""
        self._wake.set()

    def _run(self) -> None:
        try:
            self._send_until_stopped()
        finally:
            with self._db_lock:
                self._sending = False
                if self._close_when_sent:
                    self._db.close()

    def _send_until_stopped(self) -> None:
        delay = self._retry_min_s
        while not self._stop.is_set():
            with self._sender_role() as is_sender:
                if not is_sender:
                    wait_s = 1.0
                else:
                    try:
                        ok = self.send_due()
                    except Exception:  # the sender must outlive any surprise; it logs and retries
                        log.exception("hyatlas outbox sender failed; retrying")
                        ok = False
                    if ok:
                        delay = self._retry_min_s
                        wait_s = self._idle_wait_s()
                    else:
                        wait_s = delay
                        delay = min(delay * 2, self._retry_max_s)
            self._wake.wait(wait_s)
            self._wake.clear()

    def _idle_wait_s(self) -> float:
        with self._db_lock:
            row = self._db.execute(
                "SELECT MIN(not_before) FROM ops WHERE dead = 0"
            ).fetchone()
        if row is None or row[0] is None:
            return 60.0
        return max(0.05, min(60.0, row[0] - self._clock()))

    @contextlib.contextmanager
    def _sender_role(self) -> Iterator[bool]:
        lock_path = self.path.with_suffix(".sender.lock")
        handle = private_file(lock_path).open("a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()

    def flush(self, timeout_s: float) -> bool:
        """Waits up to timeout_s until nothing due is left; False early if the server is away."""
        failures = self._failures
        self.nudge()
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._next_due() is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self._failures != failures or self._thread is None:
                    return False
                self._changed.wait(min(left, 0.1))
        return True

    def caught_up(self, timeout_s: float) -> bool:
        """Whether nothing due waits to be sent, after sending what is due (the sender thread
        for up to timeout_s; without one, this thread, once): an op sent directly while this
        is False would overtake the ops queued before it."""
        if self._thread is None:
            self.send_once()
            return self._next_due() is None
        return self.flush(timeout_s)

    def close(self, timeout_s: float = 3.0) -> None:
        """Sends what it can within timeout_s, then stops; the rest stays on disk for next time."""
        if self._thread is not None:
            self.flush(timeout_s)
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout_s)
            self._thread = None
        with self._db_lock:
            # A sender still inside a request (a server that does not answer) records its
            # outcome first; closing under it would keep a sent op queued and log a traceback.
            if self._sending:
                self._close_when_sent = True
            else:
                self._db.close()

