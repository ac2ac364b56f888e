"""`hermes hyatlas ...`: status, search, add, recent, owners, forget, restore, start, stop."""

from __future__ import annotations

import argparse
import contextlib
import json
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .client import ClientError, HyAtlasClient, Unreachable, local_now
from .health import START_HINT
from .lifecycle import ServerLauncher
from .outbox import Outbox, open_outbox
from .recall import format_recall
from .settings import (
    PluginSettings,
    hermes_home_dir,
    hermes_identity,
    load_settings,
    resolve_ids,
    state_dir,
)
from .tools import LAYERS, add_or_queue, forget_now, forget_payload, queue_counts, send_or_queue


def _owner_options(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--user-id", default=default,
                        help="Look at this user's memories (default: the plugin's user id)")
    parser.add_argument("--agent-id", default=default,
                        help="Look at this agent's memories (default: the plugin's agent id)")


def _count(raw: str) -> int:
    """A --limit: a whole number of at least 1 (the server takes 0 for its own default)."""
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def register_cli(subparser: argparse.ArgumentParser) -> None:
    """Builds the `hermes hyatlas` argument tree; --user-id and --agent-id go before or after
    the subcommand."""
    subs = subparser.add_subparsers(dest="hyatlas_command")
    _owner_options(subparser, "")
    subs.add_parser("status", help="Server status and counts per layer")
    search = subs.add_parser("search", help="Search memories")
    search.add_argument("query", nargs="+")
    search.add_argument("--layer", choices=LAYERS)
    search.add_argument("--limit", type=_count, default=10)
    search.add_argument("--json", action="store_true", help="Print the raw answer")
    add = subs.add_parser("add", help="Store a note")
    add.add_argument("text", nargs="+")
    recent = subs.add_parser("recent", help="Newest memories")
    recent.add_argument("--layer", choices=LAYERS)
    recent.add_argument("--limit", type=_count, default=20)
    recent.add_argument("--contains", default="", help="Only memories holding this text (any case)")
    owners = subs.add_parser("owners", help="Users and agents with memories (which ids to look at)")
    forget = subs.add_parser("forget", help="Forget memories by id or matching text")
    forget.add_argument("text", nargs="*")
    forget.add_argument("--id", dest="memory_id", default="")
    restore = subs.add_parser("restore", help="Bring a forgotten memory back by its id")
    restore.add_argument("memory_id")
    subs.add_parser("start", help="Start the server if it does not answer")
    subs.add_parser("stop", help="Stop the server the plugin started")
    # After the subcommand, an owner option replaces the one given before it (if any).
    for parser in (search, add, recent, owners, forget, restore):
        _owner_options(parser, argparse.SUPPRESS)
    subparser.set_defaults(func=hyatlas_command)


def _owners_table(answer: dict[str, Any], current: dict[str, str]) -> str:
    """One line per user and per agent: live and retired counts, last write; * marks ours."""
    lines = []

    def line(mark: bool, label: str, entry: dict[str, Any]) -> None:
        lines.append(f"{'*' if mark else ' '} {label:<40} {entry['live']:>7} live "
                     f"{entry['retired']:>6} retired  last write {entry['last_write_at']}")

    for user in answer.get("users", []):
        ours = user["user_id"] == current["user_id"]
        line(ours, user["user_id"], user)
        for agent in user.get("agents", []):
            line(ours and agent["agent_id"] == current["agent_id"],
                 f"  agent {agent['agent_id'] or '(none)'}", agent)
    return "\n".join(lines) or "no memories yet"


def _print(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


@contextlib.contextmanager
def _outbox(home: Path, client: HyAtlasClient) -> Iterator[Outbox]:
    """The same local queue the provider sends from (no sender thread of its own here)."""
    outbox = open_outbox(state_dir(home) / "outbox.sqlite3", client)
    try:
        yield outbox
    finally:
        outbox.close()


def _send_queued(outbox: Outbox) -> int:
    """Sends the local queue now, the writes the server refused included; 1 if it could not."""
    resent = outbox.resend_refused()
    if resent:
        print(f"{resent} refused writes queued again")
    if not outbox.pending():
        return 0
    if outbox.send_once():
        print(f"queued writes sent; {outbox.pending()} still waiting, {outbox.refused()} refused")
        return 0
    if not outbox.last_error:  # it did not try: a Hermes session holds the sender role
        print(f"a running Hermes session is sending the {outbox.pending()} queued writes")
        return 0
    print(f"hyatlas: queued writes not sent ({outbox.last_error}); {outbox.pending()} still "
          "waiting", file=sys.stderr)
    return 1


def _run(command: str, args: argparse.Namespace, settings: PluginSettings, home: Path) -> int:
    client = HyAtlasClient(settings.server_url, timeout_s=settings.timeout_s, token=settings.token)
    user_id, agent_id = resolve_ids(settings, hermes_identity())
    owner = {"user_id": args.user_id or user_id, "agent_id": args.agent_id or agent_id}
    if command == "status":
        with _outbox(home, client) as outbox:
            counts = queue_counts(outbox)
        try:
            status = client.status()
        except ClientError:
            _print(counts)  # what waits locally is worth knowing most when the server is away
            raise
        _print({**status, **counts})
    elif command == "search":
        query = " ".join(args.query)
        answer = client.search(query, limit=args.limit, layer=args.layer or "", **owner)
        print(json.dumps(answer, indent=2) if args.json else
              format_recall(answer, query, per_channel=args.limit) or "no memories found")
    elif command == "add":
        note = {"text": " ".join(args.text), "session_id": "cli", "event_at": local_now(),
                "metadata": {"write_origin": "cli"}, **owner}
        with _outbox(home, client) as outbox:
            _print(add_or_queue(client, outbox, note))
    elif command == "recent":
        _print(client.recent(limit=args.limit, layer=args.layer or "", contains=args.contains,
                             **owner))
    elif command == "owners":
        print(_owners_table(client.owners(), owner))
    elif command == "forget":
        payload = forget_payload(owner, text=" ".join(args.text).strip(),
                                 memory_id=args.memory_id.strip(), reason="hermes hyatlas forget")
        with _outbox(home, client) as outbox:
            _print(send_or_queue(outbox, "forget", payload,
                                 lambda _key: forget_now(client, payload)))
    elif command == "restore":
        _print(client.restore({"memory_id": args.memory_id, **owner}))
    elif command == "start":
        result = ServerLauncher(settings, client, home).ensure_running()
        print(result.message)
        if not result.ready:
            return 1
        with _outbox(home, client) as outbox:
            return _send_queued(outbox)
    elif command == "stop":
        print(ServerLauncher(settings, client, home).stop())
    return 0


def hyatlas_command(args: argparse.Namespace) -> None:
    """Runs one `hermes hyatlas` subcommand; exits non-zero on failure."""
    home = hermes_home_dir()
    try:
        settings = load_settings(home)
        code = _run(getattr(args, "hyatlas_command", None) or "status", args, settings, home)
    except Unreachable as exc:
        print(f"hyatlas: {exc}; {START_HINT}", file=sys.stderr)
        code = 1
    except (ClientError, ValueError, OSError, sqlite3.Error) as exc:
        print(f"hyatlas: {exc}", file=sys.stderr)
        code = 1
    if code:
        raise SystemExit(code)
