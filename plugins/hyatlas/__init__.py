"""HyAtlas long-term memory as a Hermes MemoryProvider (register_memory_provider)."""

from __future__ import annotations

import collections
import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.memory_provider import MemoryProvider

try:
    from agent.skill_commands import (
        extract_user_instruction_from_skill_message as instruction_of,
    )
except ImportError:  # a Hermes without /skill turns

    def instruction_of(content: Any) -> str | None:
        """content as it is."""
        return content if isinstance(content, str) else None

from .client import ClientError, HyAtlasClient, local_now
from .health import ServerHealth, problem_text
from .lifecycle import ServerLauncher
from .outbox import Outbox, open_outbox
from .recall import clean_message, format_recall, recall_query, turn_text
from .settings import (
    PluginSettings,
    config_schema,
    hermes_home_dir,
    load_settings,
    read_settings,
    resolve_ids,
    save_config,
    state_dir,
)
from .tools import TOOL_SCHEMAS, Scope, handle

log = logging.getLogger("hyatlas")

SESSION_CACHE = 64
"""How many sessions keep their last recall for fallback."""
CHECK_TIMEOUT_S = 5.0
"""How long the start-of-session check waits for the gateway's status."""
PROMPT_CHECK_WAIT_S = 1.0
"""How long the system prompt waits for that check, to say whether memory answers."""
UNSYNCED_KEPT = 20
"""How many user messages of turns Hermes did not sync are kept for the next turn it syncs."""


@dataclass
class Recall:
    """One search for a session's recall: its query and, once done, its text."""

    query: str
    done: threading.Event = field(default_factory=threading.Event)
    text: str | None = None
    """The recall text; None while running or when the call failed."""


class HyAtlasProvider(MemoryProvider):
    """Recall before each turn, durable writes after it, Hermes's memory tool mirrored."""

    def __init__(self) -> None:
        self.settings: PluginSettings | None = None
        self.hermes_home: Path | None = None
        self.client: HyAtlasClient | None = None
        self.outbox: Outbox | None = None
        self.launcher: ServerLauncher | None = None
        self.health = ServerHealth(PluginSettings.backoff_s)
        self.user_id = "default"
        self.agent_id = "default"
        self.session_id = ""
        self.agent_context = "primary"
        self.writes = False
        self.queue_problem = "the local queue is not open"
        """Why writes cannot be queued when the outbox is None."""
        self.config_problem = ""
        """What is wrong with a config the plugin cannot run with ("" when it can)."""
        self._recalls: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._recall_lock = threading.Lock()
        self._inflight: dict[str, Recall] = {}
        self._unsynced: list[tuple[str, str]] = []
        """What the user said in the turns started and not synced yet, and when (local_now),
        oldest first."""
        self._unsynced_lock = threading.Lock()
        self.start_thread: threading.Thread | None = None
        self.check_thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        """The provider's name in memory.provider."""
        return "hyatlas"

    # -- setup -----------------------------------------------------------------

    def is_available(self) -> bool:
        """True: makes no network call. With a config it cannot run with, the provider still
        keeps the main agent's turns in its local queue and says what is wrong at session
        start (and `hermes memory status` shows it as config_error)."""
        problems = read_settings(hermes_home_dir()).problems
        if problems:
            log.warning("hyatlas config is invalid: %s", problems[0])
        return True

    def get_status_config(self, provider_config: dict[str, Any]) -> dict[str, Any]:
        """What `hermes memory status` shows: the settings in effect (no secret), and what is
        wrong with the config, if anything."""
        settings, problems, _ = read_settings(hermes_home_dir())
        shown: dict[str, Any] = {
            key: getattr(settings, key) for key in ("server_url", "user_id", "agent_id",
                                                      "auto_start", "mode", "sync")}
        if problems:
            shown["config_error"] = "; ".join(problems)
        return shown

    def get_config_schema(self) -> list[dict[str, Any]]:
        """The fields `hermes memory setup` asks for."""
        return config_schema()

    def save_config(self, values: dict[str, Any], hermes_home: str) -> None:
        """Writes the non-secret values to $HERMES_HOME/hyatlas.json (0600)."""
        save_config(values, hermes_home)

    def post_setup(self, hermes_home: str, config: dict[str, Any]) -> None:
        """`hermes memory setup`: asks each question, checking each answer as it is given."""
        from .setup_wizard import run_setup

        run_setup(hermes_home, config)

    def backup_paths(self) -> list[str]:
        """The server's data directory when it lives outside HERMES_HOME."""
        try:
            settings = load_settings(hermes_home_dir())
        except ValueError:
            return []
        return [str(Path(settings.data_dir).expanduser().resolve())] if settings.data_dir else []

    # -- lifecycle ---------------------------------------------------------------

    def initialize(self, session_id: str, **kwargs: Any) -> None:
        """Resolves ids, opens the local queue, checks (or starts) the server in the background.

        A server that is down or refuses the token is reported through Hermes's
        warning_callback (CLI sessions), else the log.
        """
        home = Path(kwargs.get("hermes_home") or hermes_home_dir())
        settings, problems, files_read = read_settings(home)
        self.hermes_home = home
        self.session_id = session_id or ""
        self.user_id, self.agent_id = resolve_ids(settings, kwargs)
        self.health = ServerHealth(settings.backoff_s, kwargs.get("warning_callback"))
        self.agent_context = str(kwargs.get("agent_context") or "primary")
        # Cron, flush and subagent runs read memory but never write it: their prompts are not
        # the user's conversation.
        self.writes = self.agent_context == "primary"
        if problems:
            self._queue_only(home, settings, problems, files_read)
            return
        self.settings = settings
        self.client = HyAtlasClient(settings.server_url, timeout_s=settings.timeout_s,
                                    token=settings.token)
        if self.writes:
            self._open_outbox(home, self.client)
            self.launcher = ServerLauncher(settings, self.client, home)
            if settings.auto_start:
                self.start_thread = threading.Thread(
                    target=self._start_server, name="hyatlas-autostart", daemon=True)
                self.start_thread.start()
        if self.start_thread is None:
            self.check_thread = threading.Thread(
                target=self.health.check, args=(self.client, CHECK_TIMEOUT_S),
                name="hyatlas-check", daemon=True)
            self.check_thread.start()
        log.info("hyatlas memory for user=%s agent=%s context=%s at %s", self.user_id,
                 self.agent_id, self.agent_context, settings.server_url)

    def _queue_only(self, home: Path, settings: PluginSettings, problems: list[str],
                    files_read: bool) -> None:
        """A config the plugin cannot run with: no recall and no sending this session, the
        main agent's turns kept in the local queue for a session with a config that works;
        not kept when a config file could not be read, since it may name their owner."""
        self.config_problem = "; ".join(problems)
        if self.writes and files_read:
            self._open_outbox(home, HyAtlasClient(settings.server_url), send=False)
        kept = ("turns wait in the local queue until a session starts with a working config"
                if self.outbox is not None else "turns are not stored")
        self.health.failed(
            f"HyAtlas memory is off: its config is not valid ({self.config_problem}); fix it in "
            f"hyatlas.json, config.yaml or the HYATLAS_* environment. Until then no memories "
            f"are recalled and {kept}", wrap=False)

    def _open_outbox(self, home: Path, client: HyAtlasClient, *, send: bool = True) -> None:
        try:
            self.outbox = open_outbox(state_dir(home) / "outbox.sqlite3", client)
        except (OSError, sqlite3.Error) as exc:
            self.queue_problem = f"the local queue under {home} could not be opened ({exc})"
            log.error("hyatlas: %s; turns will not be stored", self.queue_problem)
            return
        if send:
            self.outbox.start()

    def _start_server(self) -> None:
        assert self.launcher is not None
        try:
            result = self.launcher.ensure_running()
        except (ClientError, OSError) as exc:
            self.health.failed(f"HyAtlas auto start failed: {exc}")
            return
        log.info("hyatlas auto start: %s", result.message)
        if not result.ready:
            self.health.failed(f"HyAtlas auto start did not get a ready server: {result.message}")
            return
        self.health.recovered()
        if self.outbox is not None:
            self.outbox.nudge()

    def on_session_switch(self, new_session_id: str, **kwargs: Any) -> None:
        """Later writes go to the new session; after a reset or an undo, the model no longer
        sees what the user said in the turns Hermes did not sync."""
        self.session_id = new_session_id or self.session_id
        if kwargs.get("reset") or kwargs.get("rewound"):
            with self._unsynced_lock:
                self._unsynced = []

    def on_session_end(self, messages: list[dict[str, Any]]) -> None:
        """Sends what is queued (bounded wait; the rest stays queued on disk)."""
        if self.outbox is not None:
            self.outbox.flush(5.0)

    def on_pre_compress(self, messages: list[dict[str, Any]]) -> str:
        """Sends what is queued before Hermes compacts; contributes no text."""
        if self.outbox is not None:
            self.outbox.flush(2.0)
        return ""

    def shutdown(self) -> None:
        """Queues what the user said in the turns Hermes did not sync (it syncs nothing after
        this), sends what it can in a few seconds and closes the queue."""
        self._queue_unsynced()
        if self.outbox is not None:
            self.outbox.close(3.0)
            self.outbox = None

    # -- recall ------------------------------------------------------------------

    def system_prompt_block(self) -> str:
        """A short note on long-term memory and its tools, true to how the server stood when
        the session started (Hermes keeps this text for the whole session)."""
        if self.config_problem:
            return ("HyAtlas long-term memory is off this session (its config is not valid): "
                    "no memories are recalled; what is said is kept locally.")
        if self.client is None:
            return ""
        if self.check_thread is not None:
            self.check_thread.join(PROMPT_CHECK_WAIT_S)
        use = ("Relevant memories arrive in <memory-context>, each dated when it happened "
               "(else when it was stored); hyatlas_search looks further, hyatlas_add stores a "
               "note, hyatlas_forget removes one.")
        if self.health.backing_off():
            return ("HyAtlas long-term memory did not answer when this session started: "
                    "memories may be missing; what is said is kept and stored once it answers. "
                    + use)
        return "HyAtlas long-term memory is active. " + use

    def _failed(self, message: str) -> None:
        """Backs recall off; warns unless auto start is still bringing the server up: it warns
        with its own outcome, which a warning before it would silence for this outage."""
        starting = self.start_thread is not None and self.start_thread.is_alive()
        self.health.failed(message, warn=not starting)

    def _recall(self, query: str, session_id: str, timeout_s: float) -> str | None:
        assert self.client is not None and self.settings is not None
        started = time.monotonic()
        try:
            answer = self.client.search(
                query, user_id=self.user_id, agent_id=self.agent_id,
                limit=self.settings.prefetch_limit, session_id=session_id, timeout_s=timeout_s,
            )
        except ClientError as exc:
            self._failed(problem_text(exc, self.client.base_url))
            return None
        # A late answer still fills the cache, but only a timely one ends a back-off.
        if time.monotonic() - started <= self.settings.prefetch_budget_s:
            self.health.recovered()
        text = format_recall(answer, query, per_channel=self.settings.prefetch_limit)
        with self._recall_lock:
            self._recalls[session_id] = text
            self._recalls.move_to_end(session_id)
            while len(self._recalls) > SESSION_CACHE:
                self._recalls.popitem(last=False)
        return text

    def _run_recall(self, recall: Recall, session_id: str) -> None:
        assert self.settings is not None
        try:
            recall.text = self._recall(recall.query, session_id, self.settings.timeout_s)
        finally:
            recall.done.set()

    def _last_recall(self, session_id: str) -> str:
        with self._recall_lock:
            return self._recalls.get(session_id, "")

    def _recall_in_background(self, query: str, session_id: str) -> Recall:
        """The session's recall of query, started unless it is running already.

        A recall of another query still running stands in for this one only during a back-off,
        when no turn waits for recall (so a stuck call never piles up threads).
        """
        with self._recall_lock:
            running = self._inflight.get(session_id)
            if running is not None and not running.done.is_set() and (
                    running.query == query or self.health.backing_off()):
                return running
            recall = Recall(query)
            self._inflight[session_id] = recall
            threading.Thread(target=self._run_recall, args=(recall, session_id),
                             name="hyatlas-recall", daemon=True).start()
            return recall

    def prefetch(self, query: str, *, session_id: str = "") -> str:
        """Memories for this turn within the budget, else the session's last recall.

        During a back-off (the server failed or overran the budget lately) the recall is not
        waited on: it runs in the background for the next turn, and this one gets the last.
        """
        if self.client is None or self.settings is None:
            return ""
        sid = session_id or self.session_id
        query = recall_query(query)
        if not query:
            return self._last_recall(sid)
        # Read before the recall starts: a quick answer could end the back-off, or replace the
        # last recall, before this thread looked (a race a loaded machine lost).
        backing_off, last = self.health.backing_off(), self._last_recall(sid)
        recall = self._recall_in_background(query, sid)
        if backing_off:
            return last
        budget_s = self.settings.prefetch_budget_s
        if not recall.done.wait(budget_s):
            self._failed(
                f"HyAtlas memory at {self.client.base_url} did not answer within {budget_s:g} s")
        # Only this query's own answer: the last recall may answer another question.
        return self._last_recall(sid) if recall.text is None else recall.text

    def queue_prefetch(self, query: str, *, session_id: str = "") -> None:
        """Warms the session's recall cache without holding Hermes's worker thread."""
        if self.client is None:
            return
        query = recall_query(query)
        if query:
            self._recall_in_background(query, session_id or self.session_id)

    # -- writes ------------------------------------------------------------------

    def _queue(self, kind: str, payload: dict[str, Any]) -> None:
        """Puts one write in the local queue; without a queue, says so for each write."""
        if self.outbox is None:
            log.warning("hyatlas: a memory %s was not stored: %s", kind, self.queue_problem)
            return
        self.outbox.put(kind, payload)

    def _owner(self, session_id: str = "") -> dict[str, str]:
        return {"user_id": self.user_id, "agent_id": self.agent_id,
                "session_id": session_id or self.session_id}

    def sync_turn(
        self,
        user_content: str,
        assistant_content: str,
        *,
        session_id: str = "",
        messages: list[dict[str, Any]] | None = None,
    ) -> None:
        """Queues the turn's user and assistant text durably, the user's with what they said in
        the turns before it that Hermes did not sync; never raises, never waits."""
        try:
            if not self.writes:
                return
            text = turn_text([*self._said_before(user_content), user_content],
                             assistant_content)
            if not text:
                return
            self._queue("add", {
                "text": text,
                **self._owner(session_id),
                "event_at": local_now(),
                "metadata": {"write_origin": "sync_turn", "source": "hermes"},
            })
        except Exception:  # a memory failure must never break the agent's turn
            log.exception("hyatlas sync_turn could not queue the turn")

    def on_turn_start(self, turn_number: int, message: str, **kwargs: Any) -> None:
        """Notes what the user said (a /skill turn by its instruction, as Hermes syncs it).

        Hermes syncs no turn the user interrupted by typing while it worked (nor one that
        failed), though the model sees that message in the next turn: that turn is stored
        with it.
        """
        said = clean_message(instruction_of(message)) if self.writes else ""
        if said:
            with self._unsynced_lock:
                self._unsynced = [*self._unsynced, (said, local_now())][-UNSYNCED_KEPT:]

    def _said_before(self, user_content: str) -> list[str]:
        """What the user said in the turns Hermes started and did not sync before this one
        (none when Hermes did not say it started), each once and none equal to it."""
        said = clean_message(user_content)
        with self._unsynced_lock:
            texts = [text for text, _ in self._unsynced]
            if said not in texts:
                return []
            at = len(texts) - 1 - texts[::-1].index(said)
            self._unsynced = self._unsynced[at + 1:]
        return [text for text in dict.fromkeys(texts[:at]) if text != said]

    def _queue_unsynced(self) -> None:
        """Queues what the user said in the turns Hermes started and did not sync as one turn
        without a reply, dated when the first of it was said; never raises."""
        with self._unsynced_lock:
            unsynced, self._unsynced = self._unsynced, []
        try:
            text = turn_text(list(dict.fromkeys(said for said, _ in unsynced)), "")
            if not self.writes or not text:
                return
            self._queue("add", {
                "text": text,
                **self._owner(),
                "event_at": unsynced[0][1],
                "metadata": {"write_origin": "sync_turn", "source": "hermes",
                             "unanswered": "the session ended before the reply"},
            })
        except Exception:  # shutting down must go on
            log.exception("hyatlas could not queue the turns Hermes did not sync")

    def on_memory_write(
        self,
        action: str,
        target: str,
        content: str,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Mirrors Hermes's memory tool: add -> raw write; replace/remove -> forget the old text."""
        try:
            if not self.writes:
                return
            # Hermes's memory tool reads a missing target as "memory"; sent empty, a forget
            # would match the entries of every target.
            target = str(target or "memory")
            meta = dict(metadata or {})
            session_id = str(meta.get("session_id") or "")
            old_text = str(meta.get("old_text") or "").strip()
            if action in ("replace", "remove"):
                if old_text:
                    self._queue("forget", {
                        "text": old_text,
                        **self._owner(session_id),
                        "reason": f"hermes memory tool {action}",
                        "source": "memory_tool",
                        "target": target,
                    })
                else:
                    log.warning("hyatlas: memory tool %s without old_text; nothing to forget",
                                action)
            if action in ("add", "replace") and content and content.strip():
                extra = {f"hermes_{k}": str(v) for k, v in meta.items()
                         if k != "old_text" and v is not None}
                self._queue("add", {
                    "text": content.strip(),
                    **self._owner(session_id),
                    "event_at": local_now(),
                    "metadata": {**extra, "write_origin": "memory_tool", "target": target},
                })
        except Exception:  # Hermes's own memory write already succeeded; never undo it
            log.exception("hyatlas could not mirror the memory tool %s", action)

    # -- tools -------------------------------------------------------------------

    def get_tool_schemas(self) -> list[dict[str, Any]]:
        """The tools of tools.TOOL_SCHEMAS: status, search, recent, add, forget and restore."""
        return [dict(schema) for schema in TOOL_SCHEMAS]

    def handle_tool_call(self, tool_name: str, args: dict[str, Any], **kwargs: Any) -> str:
        """Runs one tool; a JSON string either way."""
        if self.client is None:
            return json.dumps({"error": f"hyatlas config is not valid: {self.config_problem}"
                               if self.config_problem else "hyatlas is not initialized"})
        scope = Scope(self.client, self.user_id, self.agent_id, self.session_id, self.outbox,
                      self.writes)
        return handle(scope, tool_name, args)


def register(ctx: Any) -> None:
    """Hermes plugin entry point."""
    ctx.register_memory_provider(HyAtlasProvider())
