"""Runs inside Hermes's interpreter: drives the plugin through Hermes's own code, prints JSON.

Usage: drive.py SCENARIO '{"param": ...}'. HERMES_HOME must point at a home whose plugins/hyatlas
is the plugin under test. The last stdout line is the scenario's JSON result.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# The longest a scenario waits for a condition; it returns as soon as the condition holds.
WAIT_CEILING_S = 120.0


def _provider() -> Any:
    from plugins.memory import load_memory_provider

    provider = load_memory_provider("hyatlas")
    assert provider is not None, "Hermes did not load the hyatlas provider"
    return provider


def _manager(provider: Any, session_id: str, **init: Any) -> Any:
    from agent.memory_manager import MemoryManager

    manager = MemoryManager()
    manager.add_provider(provider)
    manager.initialize_all(session_id, platform="cli", **init)
    return manager


def discover(params: dict[str, Any]) -> dict[str, Any]:
    """Hermes's memory plugin discovery lists and loads the provider."""
    from plugins.memory import discover_memory_providers, find_provider_dir

    found = {name: {"description": desc, "available": ok}
             for name, desc, ok in discover_memory_providers()}
    provider = _provider()
    return {
        "found": found.get("hyatlas"),
        "dir": str(find_provider_dir("hyatlas")),
        "name": provider.name,
        "class": type(provider).__name__,
        "tools": [schema["name"] for schema in provider.get_tool_schemas()],
        "schema": provider.get_config_schema(),
    }


def _settle_recall(provider: Any, session_id: str) -> None:
    """Waits for the session's recall in flight, if any (the ceiling only guards a hang)."""
    recall = provider._inflight.get(session_id)
    if recall is not None:
        recall.done.wait(WAIT_CEILING_S)


def turns(params: dict[str, Any]) -> dict[str, Any]:
    """MemoryManager: initialize -> (prefetch, sync_turn, queue_prefetch) per turn -> shutdown."""
    provider = _provider()
    session = params["session_id"]
    manager = _manager(provider, session, agent_context="primary",
                       **params.get("init", {}))
    recalls, flushed = [], []
    for user, assistant in params["turns"]:
        recalls.append(manager.prefetch_all(user, session_id=session))
        manager.sync_all(user, assistant, session_id=session,
                         messages=[{"role": "user", "content": user},
                                   {"role": "assistant", "content": assistant}])
        manager.queue_prefetch_all(user, session_id=session)
        manager.flush_pending(timeout=WAIT_CEILING_S)
        flushed.append(provider.outbox.flush(WAIT_CEILING_S))
    # As Hermes does before a turn: queue the recall, then prefetch. Waiting for the recall in
    # flight (not for a clock) makes the answer the same on an idle or a loaded machine.
    _settle_recall(provider, session)
    manager.queue_prefetch_all(params["final_query"], session_id=session)
    _settle_recall(provider, session)
    final = manager.prefetch_all(params["final_query"], session_id=session)
    system_prompt = manager.build_system_prompt()
    ids = {"user_id": provider.user_id, "agent_id": provider.agent_id}
    manager.on_session_end([])
    manager.shutdown_all()
    return {"recalls": recalls, "final": final, "ids": ids, "system_prompt": system_prompt,
            "flushed": flushed}


class _Chat(BaseHTTPRequestHandler):
    """A chat-completions model that, for the user message `held`, first calls Hermes's todo
    tool when `tool` is set, then holds its answer until `release` is set (`holding` says it
    does); it answers any other message at once."""

    held = ""
    tool = False
    asked: list[str] = []
    holding = threading.Event()
    release = threading.Event()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        messages = body.get("messages") or [{}]
        said = [m.get("content") for m in messages if m.get("role") == "user"]
        last = said[-1] if said and isinstance(said[-1], str) else ""
        _Chat.asked.append(last)
        if last == _Chat.held and _Chat.tool and messages[-1].get("role") != "tool":
            todo = {"todos": [{"id": "1", "content": "pets", "status": "pending"}]}
            self._answer(body, {"role": "assistant", "content": None, "tool_calls": [
                {"index": 0, "id": "call-1", "type": "function",
                 "function": {"name": "todo", "arguments": json.dumps(todo)}}]}, "tool_calls")
            return
        if last == _Chat.held:
            _Chat.holding.set()
            _Chat.release.wait(WAIT_CEILING_S)
        self._answer(body, {"role": "assistant", "content": "Noted, both."}, "stop")

    def _answer(self, body: dict[str, Any], message: dict[str, Any], finish: str) -> None:
        head = {"id": "c", "created": 0, "model": body.get("model", "")}
        if body.get("stream"):
            chunk = {**head, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": message, "finish_reason": finish}]}
            data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            kind = "text/event-stream"
        else:
            data = json.dumps({**head, "object": "chat.completion", "choices": [
                {"index": 0, "message": message, "finish_reason": finish}], "usage": {
                    "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
            kind = "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def interrupted(params: dict[str, Any]) -> dict[str, Any]:
    """Hermes's agent runs a turn (with params["tool"], the model first calls a tool); the user
    types another message while the model works, which interrupts it (as the CLI does), and
    that message runs as the next turn. What was queued."""
    from run_agent import AIAgent

    first, second = params["first"], params["second"]
    _Chat.held, _Chat.tool = first, bool(params.get("tool"))
    chat = ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
    threading.Thread(target=chat.serve_forever, daemon=True).start()
    agent = AIAgent(base_url=f"http://127.0.0.1:{chat.server_port}/v1", api_key="k",
                    model="fake-model", quiet_mode=True, session_id="s-interrupted",
                    enabled_toolsets=["todo"] if _Chat.tool else [], skip_context_files=True,
                    platform="cli")
    provider = agent._memory_manager._providers[-1]
    outcome: dict[str, Any] = {}
    turn = threading.Thread(target=lambda: outcome.update(agent.run_conversation(first)))
    turn.start()
    _Chat.holding.wait(WAIT_CEILING_S)
    agent.interrupt(second)
    _Chat.release.set()
    turn.join(WAIT_CEILING_S)
    agent.run_conversation(outcome.get("interrupt_message") or second,
                           conversation_history=outcome.get("messages"))
    agent._memory_manager.flush_pending(timeout=WAIT_CEILING_S)
    flushed = provider.outbox.flush(WAIT_CEILING_S)
    agent._memory_manager.shutdown_all()
    chat.shutdown()
    return {"interrupted": outcome.get("interrupted"), "asked": _Chat.asked,
            "flushed": flushed}


def started(params: dict[str, Any]) -> dict[str, Any]:
    """MemoryManager calls as Hermes makes them, each step one of ["start", message] (a turn
    starts), ["sync", user, assistant] (it completes) or ["reset", session_id] (/new)."""
    provider = _provider()
    manager = _manager(provider, "s-started", agent_context="primary")
    _take_steps(provider, manager, params["steps"])
    flushed = provider.outbox.flush(WAIT_CEILING_S)
    manager.shutdown_all()
    return {"flushed": flushed}


def _take_steps(provider: Any, manager: Any, steps: list[list[str]]) -> None:
    for step, *args in steps:
        if step == "start":
            manager.on_turn_start(1, args[0])
        elif step == "sync":
            manager.sync_all(args[0], args[1], session_id=provider.session_id)
            manager.flush_pending(timeout=WAIT_CEILING_S)
        else:
            manager.on_session_switch(args[0], reset=True)


def quit_session(params: dict[str, Any]) -> dict[str, Any]:
    """The steps of `started`, then the session ends as Hermes's CLI ends it on quit (its
    session end, then shutdown); then a new session sends what the old one left queued."""
    provider = _provider()
    manager = _manager(provider, "s-quit", agent_context="primary")
    _take_steps(provider, manager, params["steps"])
    manager.on_session_end([])
    manager.shutdown_all()
    later = _provider()
    later.initialize("s-later", hermes_home=os.environ["HERMES_HOME"], platform="cli",
                     agent_context="primary")
    flushed = later.outbox.flush(WAIT_CEILING_S)
    later.shutdown()
    return {"flushed": flushed}


def next_question(params: dict[str, Any]) -> dict[str, Any]:
    """Hermes queues a recall with the turn's message, then the next turn asks another."""
    provider = _provider()
    session = "s-next"
    manager = _manager(provider, session, agent_context="primary")
    manager.queue_prefetch_all(params["queued"], session_id=session)
    manager.flush_pending(timeout=WAIT_CEILING_S)  # the queued recall is in flight now
    recall = manager.prefetch_all(params["asked"], session_id=session)
    manager.shutdown_all()
    return {"recall": recall}


def memory_tool(params: dict[str, Any]) -> dict[str, Any]:
    """Hermes's memory tool add/replace/remove, mirrored the way the agent loop does it."""
    from tools.memory_tool import MemoryStore
    from tools.memory_tool import memory_tool as run_memory_tool

    provider = _provider()
    session = params["session_id"]
    manager = _manager(provider, session, agent_context="primary")
    store = MemoryStore()
    store.load_from_disk()
    results = []
    for call in params["calls"]:
        result = run_memory_tool(store=store, **call)
        manager.notify_memory_tool_write(
            result, call,
            build_metadata=lambda: {"write_origin": "assistant_tool", "session_id": session,
                                    "platform": "cli", "tool_name": "memory"},
        )
        results.append(json.loads(result))
    provider.outbox.flush(10.0)
    queue = provider.outbox.snapshot()
    manager.shutdown_all()
    return {"results": results, "queue": queue}


def memory_writes(params: dict[str, Any]) -> dict[str, Any]:
    """MemoryManager.on_memory_write with each [action, target, content, metadata] as given."""
    provider = _provider()
    manager = _manager(provider, params["session_id"], agent_context="primary")
    for action, target, content, metadata in params["calls"]:
        manager.on_memory_write(action, target, content, metadata=metadata)
    flushed = provider.outbox.flush(WAIT_CEILING_S)
    manager.shutdown_all()
    return {"flushed": flushed}


def mirrored_until_sent(params: dict[str, Any]) -> dict[str, Any]:
    """Memory-tool writes through MemoryManager.on_memory_write, then waits until every add
    left the queue; what is still queued then."""
    provider = _provider()
    manager = _manager(provider, params["session_id"], agent_context="primary")
    for action, target, content, metadata in params["calls"]:
        manager.on_memory_write(action, target, content, metadata=metadata)
    deadline = time.monotonic() + WAIT_CEILING_S
    while provider.outbox.pending("add") and time.monotonic() < deadline:
        time.sleep(0.05)
    queue = provider.outbox.snapshot()
    manager.shutdown_all()
    return {"queue": queue}


def tool_calls(params: dict[str, Any]) -> dict[str, Any]:
    """The provider's own tools, dispatched by MemoryManager.handle_tool_call."""
    provider = _provider()
    manager = _manager(provider, params["session_id"], agent_context="primary",
                       **params.get("init", {}))
    answers = [json.loads(manager.handle_tool_call(name, args)) for name, args in params["calls"]]
    ids = {"user_id": provider.user_id, "agent_id": provider.agent_id}
    manager.shutdown_all()
    return {"answers": answers, "ids": ids}


def context_writes(params: dict[str, Any]) -> dict[str, Any]:
    """A non-primary agent context reads but never writes."""
    provider = _provider()
    manager = _manager(provider, "cron-session", agent_context=params["agent_context"])
    manager.sync_all("cron prompt text", "cron answer", session_id="cron-session")
    manager.flush_pending(timeout=10)
    manager.on_memory_write("add", "memory", "note from cron", metadata={})
    tool = json.loads(manager.handle_tool_call("hyatlas_add", {"text": "from cron"}))
    writes = provider.writes
    manager.shutdown_all()
    return {"writes": writes, "tool": tool, "outbox": provider.outbox is not None}


class _Collected(logging.Handler):
    """Keeps the messages logged at WARNING and above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def logged_writes(params: dict[str, Any]) -> dict[str, Any]:
    """A turn and a memory-tool add of the main agent; what the plugin logged meanwhile."""
    collected = _Collected()
    logging.getLogger("hyatlas").addHandler(collected)
    provider = _provider()
    manager = _manager(provider, "s-logged", agent_context="primary")
    manager.sync_all("My car is blue", "Noted.", session_id="s-logged")
    manager.flush_pending(timeout=WAIT_CEILING_S)
    manager.on_memory_write("add", "memory", "Car: blue", metadata={})
    manager.shutdown_all()
    return {"logged": collected.messages}


def down(params: dict[str, Any]) -> dict[str, Any]:
    """Gateway away: prefetch and sync_turn return without raising; turns wait on disk."""
    provider = _provider()
    session = params["session_id"]
    provider.initialize(session, hermes_home=os.environ["HERMES_HOME"], platform="cli",
                        agent_context="primary")
    prefetch_s = []
    errors = []
    for user, assistant in params["turns"]:
        started = time.monotonic()
        try:
            provider.prefetch(user, session_id=session)
        except Exception as exc:  # recorded: the test asserts there is none
            errors.append(f"prefetch: {exc!r}")
        prefetch_s.append(time.monotonic() - started)
        try:
            provider.sync_turn(user, assistant, session_id=session)
        except Exception as exc:
            errors.append(f"sync_turn: {exc!r}")
    pending = provider.outbox.pending()
    provider.on_session_end([])
    provider.shutdown()
    return {"prefetch_s": prefetch_s, "errors": errors, "pending": pending}


def outage(params: dict[str, Any]) -> dict[str, Any]:
    """A CLI session as Hermes starts one (with its warning callback), then prefetches."""
    warnings: list[str] = []
    provider = _provider()
    session = "s-outage"
    manager = _manager(provider, session, agent_context="primary",
                       warning_callback=warnings.append)
    if params.get("await_check"):
        provider.check_thread.join(WAIT_CEILING_S)
    system_prompt = manager.build_system_prompt()
    prefetch_s, recalls, backing_off = [], [], []
    for query in params.get("prefetch", []):
        started = time.monotonic()
        recalls.append(manager.prefetch_all(query, session_id=session))
        prefetch_s.append(time.monotonic() - started)
        if params.get("settle"):  # the recall this turn started has finished, late or not
            _settle_recall(provider, session)
        backing_off.append(provider.health.backing_off())
    manager.shutdown_all()
    return {"warnings": warnings, "prefetch_s": prefetch_s, "recalls": recalls,
            "backing_off": backing_off, "system_prompt": system_prompt}


def misconfigured(params: dict[str, Any]) -> dict[str, Any]:
    """A CLI session as Hermes's agent starts one (the provider only when it is available) with
    a config the plugin cannot run with, and one turn: what was warned and queued, the status
    tool's answer and what `hermes memory status` shows (pending None: no local queue)."""
    warnings: list[str] = []
    provider = _provider()
    if not provider.is_available():
        return {"available": False, "warnings": warnings}
    manager = _manager(provider, "s-misconfigured", agent_context="primary",
                       warning_callback=warnings.append)
    manager.sync_all("My locker code is 2231", "Noted.", session_id="s-misconfigured")
    manager.flush_pending(timeout=WAIT_CEILING_S)
    pending = None if provider.outbox is None else provider.outbox.pending()
    tool = json.loads(manager.handle_tool_call("hyatlas_status", {}))
    shown = provider.get_status_config({})
    system_prompt = manager.build_system_prompt()
    manager.shutdown_all()
    return {"available": True, "warnings": warnings, "pending": pending, "tool": tool,
            "status_config": shown, "system_prompt": system_prompt}


def tried(params: dict[str, Any]) -> dict[str, Any]:
    """Turns queued and each sent at least once to whatever answers at server_url; the queue
    and the status tool's answer after that."""
    provider = _provider()
    provider.initialize("s-tried", hermes_home=os.environ["HERMES_HOME"], platform="cli",
                        agent_context="primary")
    for user, assistant in params["turns"]:
        provider.sync_turn(user, assistant, session_id="s-tried")
    deadline = time.monotonic() + WAIT_CEILING_S
    while (not all(op["attempts"] for op in provider.outbox.snapshot())
           and time.monotonic() < deadline):
        time.sleep(0.05)
    queue = provider.outbox.snapshot()
    status = json.loads(provider.handle_tool_call("hyatlas_status", {}))
    provider.shutdown()
    return {"queue": queue, "status": status}


def resume(params: dict[str, Any]) -> dict[str, Any]:
    """A new Hermes process with the gateway back: the queued turns go out on their own."""
    provider = _provider()
    provider.initialize("resumed", hermes_home=os.environ["HERMES_HOME"], platform="cli",
                        agent_context="primary")
    deadline = time.monotonic() + params.get("wait_s", 30)
    while provider.outbox.pending() and time.monotonic() < deadline:
        time.sleep(0.1)
    pending = provider.outbox.pending()
    provider.shutdown()
    return {"pending": pending}


def _modes(folder: str) -> dict[str, str]:
    """The permission bits of folder and of each file in it, by name ("." for folder)."""
    names = [".", *os.listdir(folder)]
    return {name: oct(os.stat(os.path.join(folder, name)).st_mode & 0o777) for name in names}


def autostart(params: dict[str, Any]) -> dict[str, Any]:
    """initialize with auto_start spawns the server once (two agents racing), env allowlisted;
    the modes of the plugin's state files while everything is open, under params["umask"]."""
    if "umask" in params:
        os.umask(params["umask"])
    os.environ.update(params.get("extra_env", {}))
    first, second = _provider(), _provider()
    for p in (first, second):
        p.initialize("s-" + str(id(p)), hermes_home=os.environ["HERMES_HOME"], platform="cli",
                     agent_context="primary")
    for p in (first, second):
        p.start_thread.join(60)
    pid = first.launcher.read_pid()
    ready = first.client.ready()
    modes = _modes(os.path.join(os.environ["HERMES_HOME"], "hyatlas"))
    stopped = first.launcher.stop() if params.get("stop") else ""
    for p in (first, second):
        p.shutdown()
    return {"pid": pid, "ready": ready, "stopped": stopped, "modes": modes,
            "alive_after_stop": first.launcher.read_pid() is not None}


def starting(params: dict[str, Any]) -> dict[str, Any]:
    """A CLI session whose auto start is still waiting for the server when the first turn
    recalls; then the server process goes away. What Hermes's warning callback got."""
    warnings: list[str] = []
    provider = _provider()
    manager = _manager(provider, "s-starting", agent_context="primary",
                       warning_callback=warnings.append)
    deadline = time.monotonic() + WAIT_CEILING_S
    while provider.launcher.read_pid() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    recall = manager.prefetch_all("what is my name", session_id="s-starting")
    _settle_recall(provider, "s-starting")
    still_starting = provider.start_thread.is_alive()
    warned_while_starting = list(warnings)
    provider.launcher.stop(grace_s=WAIT_CEILING_S)
    provider.start_thread.join(WAIT_CEILING_S)
    manager.shutdown_all()
    return {"recall": recall, "still_starting": still_starting,
            "warned_while_starting": warned_while_starting, "warnings": warnings}


def dashboard(params: dict[str, Any]) -> dict[str, Any]:
    """Hermes's web server mounts the plugin's router and it proxies a search."""
    os.environ["HERMES_DASHBOARD_SESSION_TOKEN"] = "test-session-token"
    from fastapi.testclient import TestClient
    from hermes_cli import web_server

    client = TestClient(web_server.app)
    headers = {"X-Hermes-Session-Token": "test-session-token"}
    plugins = client.get("/api/dashboard/plugins", headers=headers).json()
    search = client.get("/api/plugins/hyatlas/search", params={"q": params["query"]},
                        headers=headers)
    status = client.get("/api/plugins/hyatlas/status", headers=headers)
    asset = client.get("/dashboard-plugins/hyatlas/dist/index.js")
    return {
        "plugins": [p.get("name") for p in plugins],
        "search_status": search.status_code,
        "search": search.json(),
        "status_status": status.status_code,
        "asset_status": asset.status_code,
    }


def config(params: dict[str, Any]) -> dict[str, Any]:
    """save_config and the precedence order, through the loaded provider."""
    provider = _provider()
    home = os.environ["HERMES_HOME"]
    provider.save_config(params["values"], home)
    settings_mod = sys.modules[type(provider).__module__ + ".settings"]
    path = os.path.join(home, "hyatlas.json")
    with open(path, encoding="utf-8") as handle:
        saved = json.load(handle)
    loaded = settings_mod.load_settings(home, params.get("environ", {}))
    return {"mode": oct(os.stat(path).st_mode & 0o777), "saved": saved,
            "loaded": {k: getattr(loaded, k) for k in params["read"]},
            "available": provider.is_available()}


def refused_config(params: dict[str, Any]) -> dict[str, Any]:
    """save_config of params["values"]: its error, and hyatlas.json's text after it."""
    provider = _provider()
    home = os.environ["HERMES_HOME"]
    try:
        provider.save_config(params["values"], home)
    except ValueError as exc:
        error = str(exc)
    else:
        error = ""
    path = Path(home) / "hyatlas.json"
    saved = path.read_text(encoding="utf-8") if path.exists() else None
    return {"error": error, "saved": saved, "available": provider.is_available()}


def refused_settings(params: dict[str, Any]) -> dict[str, Any]:
    """The plugin's load_settings on each environment: its error ("" when it loads)."""
    provider = _provider()
    settings_mod = sys.modules[type(provider).__module__ + ".settings"]
    errors = []
    for environ in params["environs"]:
        try:
            settings_mod.load_settings(os.environ["HERMES_HOME"], environ)
        except ValueError as exc:
            errors.append(str(exc))
        else:
            errors.append("")
    return {"errors": errors, "available": provider.is_available()}


def closed_mid_send(params: dict[str, Any]) -> dict[str, Any]:
    """An outbox closed while its sender waits for the server's answer to an add; the server
    answers after that. What the sender logged, and what a new outbox then finds queued."""
    import urllib.request

    provider = _provider()
    package = type(provider).__module__
    outbox_mod = sys.modules[package + ".outbox"]
    client_mod = sys.modules[package + ".client"]
    state_dir = sys.modules[package + ".settings"].state_dir
    path = state_dir(os.environ["HERMES_HOME"]) / "outbox.sqlite3"
    url = params["server_url"]
    client = client_mod.HyAtlasClient(url, timeout_s=WAIT_CEILING_S)
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("hyatlas.outbox").addHandler(handler)
    outbox = outbox_mod.Outbox(path, client)
    outbox.start()
    outbox.put("add", {"text": "USER: the gate code is 1942", "user_id": "u-closed",
                       "agent_id": "default", "session_id": "s-closed"})
    deadline = time.monotonic() + WAIT_CEILING_S
    while time.monotonic() < deadline:  # until the add is in flight
        with urllib.request.urlopen(url + "/seen", timeout=10) as reply:
            if json.loads(reply.read())["seen"]:
                break
        time.sleep(0.05)
    sender = outbox._thread
    outbox.close(0.1)
    urllib.request.urlopen(urllib.request.Request(url + "/release", method="POST"), timeout=10)
    sender.join(WAIT_CEILING_S)
    reopened = outbox_mod.Outbox(path, client)
    pending = reopened.pending()
    reopened.close()
    return {"pending": pending, "logged": logged}


def aged_outbox(params: dict[str, Any]) -> dict[str, Any]:
    """Queues params["ops"] ([payload, key] pairs, or [payload, key, kind]) in the home's
    outbox, lets its clock run
    params["age_s"] on, sends once; what is left, what was dropped and what was logged."""
    provider = _provider()
    package = type(provider).__module__
    outbox_mod = sys.modules[package + ".outbox"]
    client_mod = sys.modules[package + ".client"]
    state_dir = sys.modules[package + ".settings"].state_dir
    now = [time.time()]
    outbox = outbox_mod.Outbox(
        state_dir(os.environ["HERMES_HOME"]) / "outbox.sqlite3",
        client_mod.HyAtlasClient(params["server_url"], token=params.get("token", "")),
        max_ops=params.get("max_ops", outbox_mod.MAX_OPS), clock=lambda: now[0],
    )
    erased = params.get("erase_after_first_page")
    if erased:  # a row of the owner is deleted on the server while the outbox pages its rows
        listing = outbox.client.recent

        def recent_then_erase(**query: Any) -> Any:
            page = listing(**query)
            if erased and not query.get("offset") and not query.get("before"):
                outbox.client.request("POST", "/api/v1/delete_all", {
                    "id": erased.pop(), "user_id": query["user_id"]})
            return page

        outbox.client.recent = recent_then_erase
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("hyatlas.outbox").addHandler(handler)
    for payload, key, *kind in params["ops"]:
        outbox.put(kind[0] if kind else "add", payload, key)
    now[0] += params["age_s"]
    sent = outbox.send_once() if params.get("send", True) else None
    result = {"sent": sent, "queued": [op["payload"]["text"] for op in outbox.snapshot()],
              "dropped": outbox.dropped(), "logged": logged}
    outbox.close()
    return result


SCENARIOS = {f.__name__: f for f in (discover, turns, interrupted, started, quit_session,
                                     next_question, memory_tool, memory_writes, mirrored_until_sent,
                                     tool_calls, context_writes, logged_writes, down, outage,
                                     misconfigured, tried, resume, autostart, starting, dashboard,
                                     config, refused_config, refused_settings, closed_mid_send,
                                     aged_outbox)}


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    scenario = SCENARIOS[sys.argv[1]]
    params = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    result = scenario(params)
    sys.stdout.flush()
    print("\n" + json.dumps(result, default=str))
    # Daemon threads of Hermes or the plugin must not hold the process open.
    threading.Event().wait(0)


if __name__ == "__main__":
    main()
