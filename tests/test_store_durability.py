"""A store puts every index and snapshot file in place so that a power loss cannot leave an
empty or torn one under its name: seen in the system calls it makes."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from tests.store_state import LAYERS, insert
from tests.support import ROOT, ServiceProcess, assert_eventually, running_stack

pytestmark = pytest.mark.skipif(
    shutil.which("strace") is None
    or subprocess.run(["strace", "-qq", "true"], capture_output=True).returncode != 0,
    reason="needs strace to see the store's system calls",
)

# Each process and thread, only the calls that flush or rename, paths for file descriptors.
_STRACE = ("strace", "-f", "-qq", "-y", "-e", "trace=fsync,fdatasync,rename,renameat,renameat2",
           "-e", "signal=none")
# `123 fsync(7</a/b>) = 0`, `123 rename("/a/b.tmp", "/a/b") = 0` (Rust's renames are renameat),
# and a call another thread cut in two: `123 fsync(7</a/b> <unfinished ...>`, then
# `123 <... fsync resumed>) = 0`.
_LINE = re.compile(r"^(\d+) +(?:<\.\.\. )?(\w+)(?: resumed>)?\(?(.*)$")


def _events(trace: Path) -> list[tuple[str, str]]:
    """The traced process's flushes ("synced", path) and renames ("renamed", to path) that
    succeeded, in the order they ended; a rename's source comes just before it, as ("from",
    path)."""
    events: list[tuple[str, str]] = []
    started: dict[str, tuple[str, str]] = {}  # pid -> the call it began, its arguments
    for line in trace.read_text().splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        pid, call, rest = match.groups()
        if rest.endswith("<unfinished ...>"):
            started[pid] = (call, rest)
            continue
        if "resumed>" in line:
            call, args = started.pop(pid)
            rest = args + rest
        if not re.search(r"= 0$", rest):
            continue
        if call in ("fsync", "fdatasync"):
            events.append(("synced", re.findall(r"<([^>]*)>", rest)[0]))
        elif call.startswith("rename"):
            source, target = re.findall(r'"([^"]*)"', rest)[:2]
            events += [("from", source), ("renamed", target)]
    return events


def _stop_traced(store: ServiceProcess) -> None:
    """Stops a store run under strace, which holds SIGTERM back from what it runs."""
    tracer = store.proc
    assert tracer is not None
    traced = Path(f"/proc/{tracer.pid}/task/{tracer.pid}/children").read_text().split()
    os.kill(int(traced[0]), signal.SIGTERM)
    assert tracer.wait(60) == 0


async def test_every_file_a_store_renames_into_place_is_synced_before_and_its_folder_after(
    tmp_path: Path, embedder_address: str
) -> None:
    data_dir, trace = tmp_path / "data", tmp_path / "store.strace"
    user = f"user-{uuid.uuid4().hex[:8]}"
    scope = common_pb2.Scope(user_id=user)
    with running_stack(
        data_dir, [], HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_SNAPSHOT_DIR=str(tmp_path / "snapshots"),
    ) as stack:
        store = stack.start("store", wrapper=(*_STRACE, "-o", str(trace)))
        try:
            async with open_channel(stack.address("store")) as channel:
                stub = store_pb2_grpc.StoreStub(channel)
                await stub.Apply(store_pb2.ApplyRequest(scope=scope, actor="api", ops=[
                    insert(user, "l2_raw", "the zephyrine lighthouse keeper"),
                    insert(user, "l3_fact", "the keeper's cat is called Marmalade"),
                ]), timeout=60)
                # The vector index saved, a snapshot taken.
                await stub.Flush(store_pb2.FlushRequest(), timeout=60)
                await stub.TakeSnapshot(store_pb2.TakeSnapshotRequest(), timeout=60)
                # An erase: the keyword indexes are built anew and swapped in.
                await stub.DeleteMemories(store_pb2.DeleteMemoriesRequest(
                    scope=scope, layers=[LAYERS.index("l2_raw") + 1], actor="api"
                ), timeout=60)
            with contextlib.closing(sqlite3.connect(data_dir / "hyatlas.db")) as db:
                await assert_eventually(lambda: db.execute(
                    "SELECT count(*) FROM store_meta WHERE key = 'keywords_purge'"
                ).fetchone() == (0,))
        finally:
            _stop_traced(store)

    # A user of few vectors has a flat index, built from SQLite rather than saved: no .usearch
    # file here (the re-embed test below syncs one).
    kinds = {Path(path).suffix or Path(path).name for path in _put_in_place(trace)}
    assert {".reserve", "applied", "own", "context", ".zip"} <= kinds, kinds


def test_a_reembed_syncs_the_index_files_it_builds_and_the_folder_it_swaps_in(
    tmp_path: Path,
) -> None:
    script = (
        "import sys\nfrom pathlib import Path\nimport numpy as np\n"
        "from services.store import index\n"
        "from services.store.index import write_index_file\n"
        "index.FLAT_UP_TO = 1\n"  # a usearch index: a flat one is written nowhere
        "from services.store.reembed import settle_index_folders\n"
        "folder = Path(sys.argv[1], 'vectors')\n"
        "ready = Path(sys.argv[1], 'vectors.next')\n"
        "folder.mkdir()\n"
        "ready.mkdir()\n"
        "write_index_file(ready / 'bob.usearch', 4, np.arange(1, 3, dtype=np.uint64), "
        "np.ones((2, 4), dtype=np.float32))\n"
        "(ready / 'MODEL').write_text('new')\n"
        "settle_index_folders(folder, 'new')\n"  # a store opened after the switch committed
    )
    trace = tmp_path / "swap.strace"
    subprocess.run(
        [*_STRACE, "-o", str(trace), sys.executable, "-c", script, str(tmp_path)],
        cwd=ROOT, check=True,
    )
    assert _put_in_place(trace) == [str(tmp_path / "vectors")]
    assert ("synced", str(tmp_path / "vectors.next" / "bob.usearch")) in _events(trace)


def _put_in_place(trace: Path) -> list[str]:
    """The paths the traced process put files or folders in place at, each checked to have
    been synced before its rename and its folder after."""
    events = _events(trace)
    checked = []
    for at, (what, path) in enumerate(events):
        source = events[at - 1][1]
        # Not put in place: a folder moved aside to be removed; tantivy's own meta files
        # (written under its tempfile names).
        if what != "renamed" or path.endswith(".old") or Path(source).name.startswith(".tmp"):
            continue
        assert ("synced", source) in events[: at - 1], f"{source} not synced before its rename"
        parent = str(Path(path).parent)
        assert ("synced", parent) in events[at + 1 :], f"{parent} not synced after {path}"
        checked.append(path)
    return checked
