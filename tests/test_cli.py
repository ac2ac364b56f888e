"""The `hyatlas` admin command line against a real gateway, store and search."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from hyatlas_cli.main import parser
from tests.store_state import call
from tests.support import ROOT, Stack, assert_eventually, running_stack, serving_http

pytestmark = pytest.mark.slow

TOKEN = "cli-t0ken"
ALICE_APP = "cli-alice-app-0123456789"  # a token reaching one owner
TOKENS = {"tokens": [{"name": "alice-app", "token": ALICE_APP, "users": ["alice"],
                      "agents": ["*"], "scopes": ["read", "write"]}]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("cli")
    tokens_file = data_dir / "tokens.json"
    tokens_file.write_text(json.dumps(TOKENS))
    with running_stack(
        data_dir,
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_ADMIN="on",
        HYATLAS_TOKEN=TOKEN,
        HYATLAS_TOKENS_FILE=str(tokens_file),
        HYATLAS_SNAPSHOT_DIR=str(data_dir.parent / "cli-snapshots"),
    ) as running:
        yield running


def hyatlas(stack: Stack, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    """Runs the command line as a user would, with the server and token in its environment."""
    env = {**stack.env, "HYATLAS_SERVER_URL": stack.base_url, "HYATLAS_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-m", "hyatlas_cli", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def test_the_server_url_may_come_before_or_after_the_command() -> None:
    assert parser().parse_args(["status", "--url", "http://a:1"]).url == "http://a:1"
    assert parser().parse_args(["--url", "http://b:2", "doctor"]).url == "http://b:2"
    assert parser().parse_args(["export", "-o", "f", "--url", "http://c:3"]).url == "http://c:3"
    assert parser().parse_args(["snapshot"]).url == ""


def test_import_export_and_import_again_round_trip_with_progress(
    stack: Stack, tmp_path: Path
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    lines = [
        {"type": "memory", "memory": {"user_id": user, "content": f"Note {i} about gardening."}}
        for i in range(30)
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = hyatlas(stack, "import", str(source))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["imported"] == 30
    assert "import" in done.stderr and "100%" in done.stderr  # the progress bar

    exported = tmp_path / "out.jsonl"
    done = hyatlas(stack, "export", "--user-id", user, "-o", str(exported))
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith(f"exported 30 lines to {exported}")
    written = [json.loads(line) for line in exported.read_text().splitlines()]
    assert written[0]["format"] == "hyatlas-export" and len(written) == 32
    assert written[-1] == {"type": "end", "lines": 31}

    done = hyatlas(stack, "import", str(exported))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) | {"errors": []} == {
        "lines": 30, "imported": 0, "skipped": 30, "refused": 0, "errors": [], "stopped": False,
        "complete": True,
    }

    # A copy cut at a line's end: what it holds is taken, and the exit code says it is short.
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(line + "\n" for line in exported.read_text().splitlines()[:11]))
    done = hyatlas(stack, "import", str(cut))
    assert done.returncode == 1, done.stderr
    reply = json.loads(done.stdout)
    assert (reply["lines"], reply["skipped"], reply["complete"]) == (10, 10, False), reply
    assert reply["error"].startswith("the export's end line is missing"), reply


async def _ok(stack: Stack, path: str, body: dict[str, object]) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    status, reply = await call(stack, "POST", path, json=body, headers=headers)
    assert status == 200, reply


async def test_export_gone_and_import_sync_carry_edits_and_deletes(
    stack: Stack, tmp_path: Path
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    ids = [f"{user}-{n}" for n in range(3)]
    seeded = tmp_path / "seed.jsonl"
    seeded.write_text("".join(
        json.dumps({"type": "memory", "memory": {"id": id_, "user_id": user,
                                                 "content": f"Note {id_} about rowing."}}) + "\n"
        for id_ in ids
    ))
    assert (await asyncio.to_thread(hyatlas, stack, "import", str(seeded))).returncode == 0
    older = tmp_path / "older.jsonl"
    done = await asyncio.to_thread(hyatlas, stack, "export", "--user-id", user, "-o", str(older))
    assert done.returncode == 0, done.stderr
    await _ok(stack, "/api/v1/update", {"user_id": user, "id": ids[0], "text": "Rowing daily."})
    await _ok(stack, "/api/v1/delete_all", {"user_id": user, "id": ids[1]})
    plain, newer = tmp_path / "plain.jsonl", tmp_path / "newer.jsonl"
    for args, out in (((), plain), (("--gone",), newer)):
        done = await asyncio.to_thread(
            hyatlas, stack, "export", "--user-id", user, *args, "-o", str(out))
        assert done.returncode == 0, done.stderr
    gone = [json.loads(line) for line in newer.read_text().splitlines()][-2]
    assert gone == {"type": "gone", "gone": {"kind": "memory", "id": ids[1], "user_id": user,
                                             "agent_id": ""}}
    assert newer.read_text().splitlines()[1:-2] == plain.read_text().splitlines()[1:-1]
    # Its header says it has gone lines: version 2, which a server from before them refuses.
    assert [json.loads(out.read_text().partition("\n")[0])["version"]
            for out in (plain, newer)] == [1, 2]
    assert '"type": "gone"' not in plain.read_text()

    def imported(*args: str) -> dict[str, object]:
        done = hyatlas(stack, "import", *args)
        assert done.returncode == 0, done.stderr
        reply: dict[str, object] = json.loads(done.stdout)
        return {name: reply.get(name) for name in ("imported", "skipped", "updated", "erased")}

    # Without --sync the older file only adds back the deleted row, and the gone line skips.
    assert await asyncio.to_thread(imported, str(older)) == {
        "imported": 1, "skipped": 2, "updated": None, "erased": None}
    assert await asyncio.to_thread(imported, str(newer)) == {
        "imported": 0, "skipped": 4, "updated": None, "erased": None}
    # With it the older file rolls the edited row back (and its neighbours' context keys),
    # and the newer one forward again, deleting the row its gone line names.
    back = await asyncio.to_thread(imported, "--sync", str(older))
    assert (back["imported"], back["erased"]) == (0, 0) and back["updated"], back
    forward = await asyncio.to_thread(imported, str(newer), "--sync")
    assert (forward["imported"], forward["erased"]) == (0, 1) and forward["updated"], forward
    done = await asyncio.to_thread(hyatlas, stack, "export", "--user-id", user, "--gone")
    assert done.stdout.splitlines()[1:-1] == newer.read_text().splitlines()[1:-1]


def test_a_refused_line_exits_1_and_prints_its_number(stack: Stack, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "memory", "memory": {"user_id": "x"}}\n')
    done = hyatlas(stack, "import", str(bad))
    assert done.returncode == 1
    assert json.loads(done.stdout)["errors"] == [
        {"line": 1, "error": "memory.content is required"}
    ]


def test_an_import_stopped_after_a_refused_line_exits_2(stack: Stack, tmp_path: Path) -> None:
    cut = tmp_path / "cut.jsonl"
    over = {"type": "memory", "memory": {"user_id": "cut", "content": "x" * (9 << 20)}}
    cut.write_text('{"type": "memory", "memory": {"user_id": "cut"}}\n' + json.dumps(over) + "\n")
    done = hyatlas(stack, "import", str(cut))
    # Not 1 ("a line was refused"): lines after the stop were never read; send the file again.
    assert done.returncode == 2, done.stdout
    reply = json.loads(done.stdout)
    assert reply["stopped"] is True and reply["refused"] == 1
    assert "over the 8388608 byte limit" in done.stderr


def test_status_snapshot_and_doctor(stack: Stack) -> None:
    done = hyatlas(stack, "status")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["mode"] == "lite"
    done = hyatlas(stack, "snapshot")
    assert done.returncode == 0, done.stderr
    taken = Path(json.loads(done.stdout)["path"])
    assert taken.is_file()
    done = hyatlas(stack, "doctor")
    assert done.returncode == 0, done.stdout
    assert done.stdout.startswith("ok   services ready")
    assert "ok   status: mode=lite, embed=" in done.stdout
    # The schedule is off in these tests; the snapshot taken by hand still shows.
    assert f"ok   snapshots: schedule off (HYATLAS_SNAPSHOT_EVERY); newest {taken.name}, " in (
        done.stdout
    )


def test_doctor_says_the_snapshot_check_is_skipped_for_a_token_that_cannot_see_it(
    stack: Stack,
) -> None:
    done = hyatlas(stack, "doctor", token=ALICE_APP)
    assert done.returncode == 0, done.stdout
    assert "ok   status: mode=lite" in done.stdout
    assert done.stdout.splitlines()[-1] == (
        "skip snapshots: this token cannot see the server's snapshots"
    )


def test_a_wrong_token_is_one_line_on_stderr_and_exit_2(stack: Stack, tmp_path: Path) -> None:
    done = hyatlas(stack, "status", token="wrong")
    assert done.returncode == 2
    assert done.stderr.startswith("hyatlas status: HTTP 401: a valid bearer token is required")
    lines = tmp_path / "good.jsonl"
    lines.write_text('{"type": "memory", "memory": {"user_id": "x", "content": "fine"}}\n')
    done = hyatlas(stack, "import", str(lines), token="wrong")
    assert done.returncode == 2  # a refused request, not a refused line
    # After the progress bar, the refusal's one line.
    last = done.stderr.splitlines()[-1]
    assert last.startswith("hyatlas import: HTTP 401: a valid bearer token is required")


def test_migrating_a_server_into_itself_is_refused(stack: Stack) -> None:
    done = hyatlas(stack, "migrate", "--to", stack.base_url + "/")
    assert done.returncode == 2
    assert done.stderr.startswith(f"hyatlas migrate: --to {stack.base_url} is the server")


def test_a_refused_export_leaves_the_previous_file_as_it_was(stack: Stack, tmp_path: Path) -> None:
    previous = tmp_path / "prev.jsonl"
    previous.write_text("a good export\n")
    done = hyatlas(stack, "export", "-o", str(previous), token="wrong")
    assert done.returncode == 2
    assert done.stderr.startswith("hyatlas export: HTTP 401: a valid bearer token is required")
    assert previous.read_text() == "a good export\n"
    assert list(tmp_path.iterdir()) == [previous]  # no temporary left beside it
    done = hyatlas(stack, "export", "--user-id", "nobody", "-o", str(previous))
    assert done.returncode == 0, done.stderr
    head, end = (json.loads(line) for line in previous.read_text().splitlines())
    assert head["format"] == "hyatlas-export" and end == {"type": "end", "lines": 1}
    assert list(tmp_path.iterdir()) == [previous]


def test_a_file_that_cannot_be_read_or_written_is_one_line_and_exit_2(
    stack: Stack, tmp_path: Path
) -> None:
    missing = tmp_path / "missing.jsonl"
    done = hyatlas(stack, "import", str(missing))
    assert (done.returncode, done.stderr) == (
        2, f"hyatlas import: [Errno 2] No such file or directory: '{missing}'\n"
    )
    nowhere = tmp_path / "no-such-dir" / "out.jsonl"
    done = hyatlas(stack, "export", "-o", str(nowhere))
    assert (done.returncode, done.stderr) == (
        2, f"hyatlas export: [Errno 2] No such file or directory: '{nowhere}'\n"
    )
    done = hyatlas(stack, "export", "-o", str(tmp_path))  # a folder: refused before exporting
    assert (done.returncode, done.stderr) == (
        2, f"hyatlas export: [Errno 21] Is a directory: '{tmp_path}'\n"
    )


# Ctrl-C as a terminal sends it: a test run started in the background (as CI's is) has SIGINT
# ignored, which its children inherit, so the command gets Python's own handler back first.
_AS_IN_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'hyatlas'; runpy.run_module('hyatlas_cli', run_name='__main__')"
)


def _started(*args: str) -> asyncio.Future[asyncio.subprocess.Process]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYATLAS_")}
    return asyncio.ensure_future(asyncio.create_subprocess_exec(
        sys.executable, "-c", _AS_IN_A_TERMINAL, *args, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    ))


async def _ended(proc: asyncio.subprocess.Process) -> tuple[int | None, str]:
    _, err = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode, err.decode()


async def test_a_url_answering_with_no_json_or_without_a_scheme_is_one_line_and_exit_2(
    tmp_path: Path,
) -> None:
    # Another web service (or a proxy's error page) at the URL: no traceback, a hint.
    async def page(request: web.Request) -> web.Response:
        return web.Response(status=501, text="<!DOCTYPE HTML><html>nope</html>",
                            content_type="text/html")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", page)
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"type": "memory", "memory": {"user_id": "u", "content": "x"}}))
    out = tmp_path / "out.jsonl"
    async with serving_http(app) as url:
        for args in (["status"], ["snapshot"], ["export", "-o", str(out)], ["import", str(source)],
                     ["migrate", "--to", "http://127.0.0.1:9"]):
            code, err = await _ended(await _started(*args, "--url", url))
            last = err.rstrip("\n").rpartition("\n")[2]  # after any progress bar
            assert code == 2 and "Traceback" not in err, (args, err)
            assert last.startswith(f"hyatlas {args[0]}: ") and "is that the HyAtlas gateway" in last
            assert f"{url} answered HTTP 501 with no JSON" in last, err
    assert await asyncio.to_thread(os.listdir, tmp_path) == [source.name]
    code, err = await _ended(await _started("status", "--url", "127.0.0.1:19528"))
    assert (code, err) == (
        2, "hyatlas status: '127.0.0.1:19528' is no gateway URL: give it as http://host:port\n"
    )


async def test_an_export_ended_without_the_end_line_its_header_promises_exits_2_leaving_no_file(
    tmp_path: Path,
) -> None:
    """A stream ended cleanly at a line's end (a proxy, a server stopped mid-way) is told from
    a whole export; an older server's export, whose header promises no end line, is whole."""
    memory = b'{"type": "memory", "memory": {"user_id": "u", "content": "x"}}\n'
    header = {"format": "hyatlas-export", "version": 1}
    bodies = {
        "cut": json.dumps({**header, "end_line": True}).encode() + b"\n" + memory,
        "older": json.dumps(header).encode() + b"\n" + memory,
    }

    async def export(request: web.Request) -> web.Response:
        return web.Response(body=bodies[request.match_info["server"]])

    app = web.Application()
    app.router.add_get("/{server}/api/v1/export", export)
    out = tmp_path / "out.jsonl"
    async with serving_http(app) as url:
        code, err = await _ended(await _started("export", "-o", str(out), "--url", url + "/cut"))
        assert code == 2, err
        assert err.rstrip("\n").rpartition("\n")[2] == (
            f"hyatlas export: export from {url}/cut is incomplete: its last line is not the end "
            "line counting the lines before it"
        )
        assert await asyncio.to_thread(os.listdir, tmp_path) == []
        code, err = await _ended(await _started("export", "-o", str(out), "--url", url + "/older"))
        assert code == 0, err
        assert err.rstrip("\n").endswith(f"exported 1 lines to {out}")
        assert await asyncio.to_thread(out.read_bytes) == bodies["older"]


async def test_ctrl_c_during_an_export_says_interrupted_and_leaves_no_file(
    tmp_path: Path,
) -> None:
    async def export(request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse()
        await reply.prepare(request)
        await reply.write(b'{"format": "hyatlas-export", "version": 1}\n')
        await asyncio.Event().wait()  # the rest never comes
        return reply

    app = web.Application()
    app.router.add_get("/api/v1/export", export)
    out = tmp_path / "out.jsonl"
    async with serving_http(app) as url:
        proc = await _started("export", "-o", str(out), "--url", url)

        def writing() -> None:
            assert any(path.name.startswith(".out.jsonl.") for path in tmp_path.iterdir())

        await assert_eventually(writing)
        proc.send_signal(signal.SIGINT)
        code, err = await _ended(proc)
    assert code == 130 and err.endswith("hyatlas export: interrupted\n"), err
    assert "Traceback" not in err
    assert await asyncio.to_thread(os.listdir, tmp_path) == []


async def test_an_export_with_gone_lines_refused_by_an_older_server_says_why(
    stack: Stack, tmp_path: Path
) -> None:
    """A server from before gone lines reads version 1 alone (its refusal's words are these),
    and ignores sync=true: a migration or an import with gone lines is refused whole there, and
    the command says what that means."""
    model = json.loads(hyatlas(stack, "status").stdout)["embed"]

    async def status(request: web.Request) -> web.Response:
        return web.json_response({"embed": model})

    async def import_(request: web.Request) -> web.Response:
        version = json.loads((await request.content.readline()) or b"{}").get("version")
        if version != 1:
            return web.json_response({"error": f"export version {version} is not 1"}, status=400)
        return web.json_response({"lines": 0, "imported": 0, "skipped": 0, "refused": 0,
                                  "errors": [], "stopped": False})

    app = web.Application()
    app.router.add_get("/api/v1/status", status)
    app.router.add_post("/api/v1/import", import_)
    exported = tmp_path / "gone.jsonl"
    done = await asyncio.to_thread(hyatlas, stack, "export", "--gone", "-o", str(exported))
    assert done.returncode == 0, done.stderr
    hint = (
        "HTTP 400: export version 2 is not 1 (that server predates gone lines and syncing "
        "imports, which an export of version 2 holds: upgrade it; an export without --gone "
        "still imports there)"
    )
    async with serving_http(app) as older:
        done = await asyncio.to_thread(hyatlas, stack, "migrate", "--to", older)
        assert done.returncode == 2
        assert done.stderr.splitlines()[-1] == f"hyatlas migrate: import into {older}: {hint}"
        done = await asyncio.to_thread(
            hyatlas, stack, "import", "--sync", str(exported), "--url", older)
        assert done.returncode == 2
        assert done.stderr.splitlines()[-1] == f"hyatlas import: {hint}"
