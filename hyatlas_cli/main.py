"""hyatlas status | export | import | migrate | snapshot | reembed | doctor: one function a
command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from hyatlas_cli.client import (
    Gateway,
    GatewayError,
    GatewayUnavailable,
    import_refusal,
    note,
    progress_bar,
)

# A scheduled snapshot older than this many intervals means the schedule has stalled.
STALE_INTERVALS = 2
# How long `hyatlas reembed` waits for an unavailable gateway or store, and its pauses between
# tries when the gateway does not say (Retry-After).
WAIT_S = 300.0
FIRST_PAUSE_S, LAST_PAUSE_S = 0.5, 10.0
# How doctor prints a check that passed, failed, or could not be made (None).
VERDICTS = {True: "ok  ", False: "FAIL", None: "skip"}


def _print(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _owner(args: argparse.Namespace) -> dict[str, str]:
    return {
        name: value
        for name, value in (("user_id", args.user_id), ("agent_id", args.agent_id))
        if value
    }


async def status(gateway: Gateway, args: argparse.Namespace) -> int:
    """Prints the server's status: mode, model, counts per layer."""
    _print(await gateway.ok("GET", "/api/v1/status"))
    return 0


async def export(gateway: Gateway, args: argparse.Namespace) -> int:
    """Writes the export to a file (or stdout), with a progress bar on stderr."""
    params = _owner(args) | ({"gone": "true"} if args.gone else {})
    if args.output == "-":
        lines = await gateway.export_to(sys.stdout.buffer, params)
    else:
        async with _replacing(Path(args.output)) as out:
            lines = await gateway.export_to(out, params)
    print(f"exported {lines} lines to {args.output}", file=sys.stderr)
    return 0


@contextlib.asynccontextmanager
async def _replacing(path: Path) -> AsyncIterator[IO[bytes]]:
    """A new file beside path, renamed over it once the block completes and removed if it
    fails: an export cut short or refused leaves the previous file as it was."""
    if await asyncio.to_thread(path.is_dir):  # refused before the export, not after it
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    try:
        out = await asyncio.to_thread(_beside, path)
    except OSError as exc:  # name the file asked for, not the temporary one
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        with out:
            yield out
        await asyncio.to_thread(os.replace, out.name, path)
    except BaseException:
        await asyncio.to_thread(Path(out.name).unlink, missing_ok=True)
        raise


def _beside(path: Path) -> IO[bytes]:
    return tempfile.NamedTemporaryFile("wb", dir=path.parent, prefix=f".{path.name}.", delete=False)


async def import_(gateway: Gateway, args: argparse.Namespace) -> int:
    """Sends a JSONL file to the import route and prints what it did; 1 if a line was refused
    or the file is an export cut short."""
    params = _owner(args) | ({"sync": "true"} if args.sync else {})
    return _imported(*await gateway.import_from(Path(args.file), params))


def _imported(code: int, reply: Any) -> int:
    """Prints an import's reply (its counts); the exit code: 0 when every line was taken, 1
    when a line was refused or the file is an export missing its end (what it held is written),
    2 (a refusal on stderr) when the request was refused or cut short (lines refused before a
    stop included)."""
    _print(reply)
    if code == 200:
        return 0
    if (
        isinstance(reply, dict)
        and (reply.get("refused") or reply.get("complete") is False)
        and not reply.get("stopped")
    ):
        return 1
    raise GatewayError(import_refusal(code, reply))


async def migrate(gateway: Gateway, args: argparse.Namespace) -> int:
    """Copies every owner's rows (vectors, keys, history) and edges into another server, such
    as a new one on PostgreSQL; ids are kept, so running it again adds what is new, replaces
    what changed and takes away what was deleted for good (or undone) since."""
    target = Gateway.target(args.to)
    if target.url == gateway.url:
        raise GatewayError(f"--to {target.url} is the server being migrated")
    models = [await _model(g) for g in (gateway, target)]
    if models[0] != models[1]:
        print(
            f"warning: {target.url} embeds with {models[1]}, not {models[0]}: every row will be "
            "embedded again there",
            file=sys.stderr,
        )
    return _imported(*await gateway.copy_to(target))


async def _model(gateway: Gateway) -> str:
    """The embedding model a server's vectors come from; a refusal names the server."""
    try:
        return str((await gateway.ok("GET", "/api/v1/status"))["embed"])
    except GatewayError as exc:
        raise GatewayError(f"{gateway.url}: {exc}") from None


async def snapshot(gateway: Gateway, args: argparse.Namespace) -> int:
    """Takes a snapshot now (needs HYATLAS_ADMIN=on) and prints where it went."""
    _print(await gateway.ok("POST", "/api/v1/admin/snapshot"))
    return 0


async def reembed(gateway: Gateway, args: argparse.Namespace) -> int:
    """Follows a re-embed to the configured model with a progress bar until the switch; waits
    out a gateway or store that stops answering for up to --wait seconds at a time."""
    state = await gateway.ok("GET", "/api/v1/status")
    job = state.get("reembed")
    if job is None and "embed_problem" in state:
        print(f"no re-embed runs: {state['embed_problem']}", file=sys.stderr)
        return 1
    if job is None:
        print(f"nothing to re-embed: every vector is of {state['embed']}", file=sys.stderr)
        return 0
    if "total" not in job:
        print(
            "this token reaches only some owners: the re-embed's counts (the whole store's) "
            "are not shown to it",
            file=sys.stderr,
        )
    with progress_bar(f"re-embed to {job['to_model']}", job.get("total")) as bar:
        while job is not None:
            _show(bar, job)
            await asyncio.sleep(args.every)
            state = await _status_waiting(gateway, args.wait)
            job = state.get("reembed")
        if bar.total is not None:
            bar.update(bar.total - bar.n)
    print(f"re-embedded: searches use {state['embed']}", file=sys.stderr)
    return 0


def _show(bar: tqdm[Any], job: dict[str, Any]) -> None:
    """Moves the bar to where a re-embed stands (its state alone when its counts are hidden)."""
    if "total" in job:
        bar.total = job["total"]
        bar.update(job["done"] - bar.n)
    bar.set_postfix_str(job["state"] + (f": {job['error']}" if job.get("error") else ""))


async def _status_waiting(gateway: Gateway, wait_s: float) -> dict[str, Any]:
    """The status; while the gateway does not answer or answers 503 (a store restarting), asked
    again after its Retry-After or a growing pause, until wait_s have gone by."""
    deadline = time.monotonic() + wait_s
    pause_s = FIRST_PAUSE_S
    while True:
        try:
            return dict(await gateway.ok("GET", "/api/v1/status"))
        except GatewayUnavailable as exc:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise GatewayError(f"{exc} (still after {wait_s:g} s of waiting)") from None
            asked_s = pause_s if exc.retry_after_s is None else exc.retry_after_s
            note(f"{exc}: asking again in {min(asked_s, left_s):.1f} s")
            await asyncio.sleep(min(asked_s, left_s))
            pause_s = min(2 * pause_s, LAST_PAUSE_S)


async def doctor(gateway: Gateway, args: argparse.Namespace) -> int:
    """Checks that every service answers, the model is usable and snapshots are recent; exit 1
    when a check fails."""
    checks: list[tuple[str, bool | None, str]] = []
    code, ready = await gateway.call("GET", "/readyz")
    services = ready.get("services", {}) if isinstance(ready, dict) else {}
    # Ready is the request path; a background service away (the consolidator) fails it too.
    every = code == 200 and all(state == "serving" for state in services.values())
    checks.append(("services ready", every, json.dumps(services)))
    code, state = await gateway.call("GET", "/api/v1/status")
    checks.append(("status", code == 200, _status_line(state) if code == 200 else str(state)))
    if code == 200:
        problem = state.get("embed_problem")
        checks.append(("model", not problem, problem or f"vectors of {state.get('embed')}"))
        behind = state.get("keyword_problem")
        checks.append(("keyword search", not behind, behind or "holds every acknowledged write"))
    code, system = await gateway.call("GET", "/dashboard/api/system")
    if code == 200:
        checks.append(_snapshot_check(system))
    elif code == 403:  # the server's view, for a token reaching every owner
        checks.append(("snapshots", None, "this token cannot see the server's snapshots"))
    for name, ok, detail in checks:
        print(f"{VERDICTS[ok]} {name}: {detail}")
    return 1 if any(ok is False for _, ok, _ in checks) else 0


def _status_line(state: dict[str, Any]) -> str:
    fields = ("mode", "embed", "vdb_points", "llm", "write_pipeline")
    return ", ".join(f"{name}={state[name]}" for name in fields if name in state)


def _snapshot_check(system: dict[str, Any]) -> tuple[str, bool, str]:
    snapshots = system["snapshots"]
    every_s, files = snapshots["every_s"], snapshots["files"]
    if system.get("store_backend") == "postgresql":
        return ("snapshots", True, "not taken on PostgreSQL: back the database up with pg_dump")
    failure = snapshots.get("last_failure")
    if failure:
        return (
            "snapshots",
            False,
            f"the last scheduled snapshot failed at {failure['at']}: {failure['reason']}; "
            f"next try at {failure['retry_at']}",
        )
    schedule = "" if every_s else "schedule off (HYATLAS_SNAPSHOT_EVERY); "
    if not files:
        return ("snapshots", True, f"{schedule}none yet in {snapshots['dir']}")
    newest = files[0]
    age_s = time.time() - _unix(newest["modified"])
    # Without a schedule no snapshot is due, so none is late.
    fresh = not every_s or age_s <= STALE_INTERVALS * every_s
    return ("snapshots", fresh, f"{schedule}newest {newest['name']}, {age_s / 3600:.1f} h old")


def _unix(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


COMMANDS: dict[str, Callable[[Gateway, argparse.Namespace], Coroutine[Any, Any, int]]] = {
    "status": status,
    "export": export,
    "import": import_,
    "migrate": migrate,
    "snapshot": snapshot,
    "reembed": reembed,
    "doctor": doctor,
}


URL_HELP = "the gateway (default: $HYATLAS_SERVER_URL)"


def parser() -> argparse.ArgumentParser:
    """The command line: one command and its options, the server URL before or after it."""
    top = argparse.ArgumentParser(prog="hyatlas", description=__doc__)
    top.add_argument("--url", default="", help=URL_HELP)
    # After the command too; SUPPRESS keeps a --url given before it when none comes after.
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--url", default=argparse.SUPPRESS, help=URL_HELP)
    subparsers = top.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str | None) -> argparse.ArgumentParser:
        return subparsers.add_parser(name, help=help_text, parents=[shared])

    command("status", status.__doc__)
    for name, help_text in (("export", export.__doc__), ("import", import_.__doc__)):
        transfer = command(name, help_text)
        transfer.add_argument("--user-id", default="", help="only this owner's memories")
        transfer.add_argument("--agent-id", default="", help="only this agent's memories")
    subparsers.choices["export"].add_argument("-o", "--output", default="-", help="file or -")
    subparsers.choices["export"].add_argument(
        "--gone",
        action="store_true",
        help="end with a gone line for each row deleted for good and each edge undone with its "
        "pass, for an import with --sync to apply",
    )
    subparsers.choices["import"].add_argument("file", help="a JSONL export or minimal lines")
    subparsers.choices["import"].add_argument(
        "--sync",
        action="store_true",
        help="replace held rows and edges whose line differs (updated) and apply gone lines "
        "(erased); without it both are skipped",
    )
    command("migrate", migrate.__doc__).add_argument(
        "--to", required=True, help="the server to copy into (its token: $HYATLAS_TO_TOKEN)"
    )
    command("snapshot", snapshot.__doc__)
    following = command("reembed", reembed.__doc__)
    following.add_argument("--every", type=float, default=1.0, help="seconds between checks")
    following.add_argument(
        "--wait",
        type=float,
        default=WAIT_S,
        help=f"seconds to wait for a gateway or store that stops answering (default {WAIT_S:g})",
    )
    command("doctor", doctor.__doc__)
    return top


def main(argv: list[str] | None = None) -> int:
    """Runs one command; a refusal, an unreachable gateway or a file that cannot be read or
    written is one line on stderr and exit 2."""
    args = parser().parse_args(argv)
    try:
        gateway = Gateway.from_env(args.url)
        return asyncio.run(COMMANDS[args.command](gateway, args))
    except (GatewayError, OSError) as exc:
        print(f"hyatlas {args.command}: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        # Ctrl-C: an export's file is left as it was; an import or migration is taken up
        # again by running it once more (the lines written are skipped).
        print(f"hyatlas {args.command}: interrupted", file=sys.stderr)
        return 130
