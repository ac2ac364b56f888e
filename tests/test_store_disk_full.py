"""A store whose data disk fills up or is read-only: it says so, reads go on, nothing is lost."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.store.disk_reserve import RESERVE_BYTES, RESERVE_NAME
from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from tests.store_state import call
from tests.support import (
    ROOT,
    ServiceProcess,
    Stack,
    assert_eventually,
    base_env,
    grpc_serving,
    running_stack,
)

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None
    or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0,
    reason="needs unshare to give the store a small file system of its own",
)


@contextlib.contextmanager
def _small_disk(folder: Path, options: str) -> Iterator[tuple[str, ...]]:
    """A tmpfs mounted on folder, seen only by the commands run under the yielded prefix (its
    namespace is held, so a store restarted under it finds the same disk)."""
    mount = f'mount -t tmpfs -o {options} tmpfs "$0" && echo mounted && exec cat'
    holder = subprocess.Popen(
        ["unshare", "-rm", "sh", "-c", mount, str(folder)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == b"mounted\n"
        # --wd: nsenter starts in the root folder; a service needs the checkout's.
        yield ("nsenter", "-t", str(holder.pid), "-U", "-m", f"--wd={ROOT}")
    finally:
        holder.stdin.close()
        holder.wait()
        holder.stdout.close()


@contextlib.contextmanager
def _stack_on_small_disk(
    tmp_path: Path, embedder_address: str, size: str, **env: str
) -> Iterator[tuple[Stack, tuple[str, ...], Path]]:
    """A store whose data folder (tmp_path/data) is a tmpfs of `size`, with search and gateway:
    the stack, the prefix commands on that disk run under, the data folder."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with _small_disk(data_dir, f"size={size}") as on_disk, running_stack(
        data_dir, [], HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_STORE_ADDR=f"unix:{tmp_path / 'store.sock'}", **env,
    ) as stack:
        stack.start("store", wrapper=on_disk)
        stack.start("search")
        stack.start("gateway")
        yield stack, on_disk, data_dir


async def test_a_full_disk_refuses_writes_with_507_keeps_reads_and_loses_nothing(
    tmp_path: Path, embedder_address: str
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    with _stack_on_small_disk(tmp_path, embedder_address, "3m", HYATLAS_ADMIN="on") as (
        stack, on_disk, data_dir,
    ):
        acked: dict[str, str] = {}  # a word only its row holds -> the row
        for _ in range(1000):
            word = "w" + uuid.uuid4().hex[:12]
            text = f"Garden shed note {word}: the blue paint is peeling " + "again " * 60
            status, body = await call(
                stack, "POST", "/api/v1/add", json={"text": text, "user_id": user}
            )
            if status != 200:
                break
            acked[word] = body["memory_id"]
        assert status == 507, body
        assert "disk is full" in body["error"] and "not kept" in body["error"]
        assert acked
        status, body = await call(stack, "POST", "/api/v1/flush")
        assert status == 507, body
        assert "disk is full" in body["error"] and "nothing was flushed" in body["error"]
        # A snapshot needs no room on the data disk: its folder is beside it, on another disk.
        status, body = await call(stack, "POST", "/api/v1/admin/snapshot")
        assert status == 200, body

        # Searched while full, and after a restart on the full disk: a keyword search that
        # misses acknowledged writes is said to (status, doctor), never silently.
        for _ in range(2):
            status, found = await call(
                stack, "POST", "/api/v1/search", json={"query": "garden shed", "user_id": user}
            )
            assert status == 200, found
            missed = set(acked) - set(await _keyword_found(stack, user, list(acked)))
            status, state = await call(stack, "GET", "/api/v1/status")
            if missed:
                assert state["status"] == "degraded" and "misses the latest writes" in (
                    state["keyword_problem"]), (missed, state)
            stack.procs["store"].stop()
            stack.start("store", wrapper=on_disk)
        assert "refused: store: the data directory's disk is full" in (
            stack.procs["gateway"].logs())

        grow = [*on_disk, "mount", "-o", "remount,size=64m", str(data_dir)]
        await asyncio.to_thread(subprocess.run, grow, check=True)
        status, body = await call(
            stack, "POST", "/api/v1/add", json={"text": "Space is back wagain", "user_id": user}
        )
        assert status == 200, body
        acked["wagain"] = body["memory_id"]
        assert await _keyword_found(stack, user, list(acked)) == acked
        status, state = await call(stack, "GET", "/api/v1/status")
        assert state["status"] == "ok" and "keyword_problem" not in state, state


async def _keyword_found(stack: Stack, user: str, words: list[str]) -> dict[str, str]:
    """The row the store's keyword index finds for each word (the last, if it finds several)."""
    found = {}
    async with open_channel(stack.address("store")) as channel:
        store = store_pb2_grpc.StoreStub(channel)
        for word in words:
            reply = await store.KeywordSearch(
                store_pb2.KeywordSearchRequest(
                    scope=common_pb2.Scope(user_id=user), query=word, k=5
                ),
                timeout=60,
            )
            for hit in reply.hits:
                found[word] = hit.hit.memory.id
    return found


def test_a_store_on_a_read_only_data_folder_exits_2_saying_so(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    env = base_env(data_dir, HYATLAS_STORE_ADDR=f"unix:{tmp_path / 'store.sock'}")
    with _small_disk(data_dir, "ro") as read_only:
        store = ServiceProcess("services.store", env, lambda: False, tmp_path / "store.log",
                               wrapper=read_only)
        with pytest.raises(RuntimeError, match="exited 2") as failed:
            store.start()
    assert f"the data folder {data_dir} is not writable" in str(failed.value)
    assert "Traceback" not in str(failed.value)


def test_a_snapshot_zip_the_disk_cannot_hold_leaves_no_partial_file(tmp_path: Path) -> None:
    staging, folder = tmp_path / "staging", tmp_path / "snapshots"
    staging.mkdir()
    folder.mkdir()
    (staging / "hyatlas.db").write_bytes(os.urandom(1 << 20))  # deflate cannot shrink it
    script = (
        "import os, sys\nfrom pathlib import Path\nfrom services.store.snapshot import _zip\n"
        "try:\n    _zip(Path(sys.argv[1]), Path(sys.argv[2], 'hyatlas-x.zip'))\n"
        "except OSError as exc:\n    print('refused', exc.errno)\n"
        "print(sorted(os.listdir(sys.argv[2])))\n"
    )
    with _small_disk(folder, "size=256k") as on_disk:
        run = subprocess.run(
            [*on_disk, sys.executable, "-c", script, str(staging), str(folder)],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )
    assert run.stdout.splitlines() == [f"refused {errno.ENOSPC}", "[]"]


async def test_a_store_restarted_on_a_full_disk_without_its_keyword_index_answers_reads(
    tmp_path: Path, embedder_address: str
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    with _stack_on_small_disk(tmp_path, embedder_address, "16m") as (stack, on_disk, data_dir):
        acked: dict[str, str] = {}  # a word only its row holds -> the row
        for word in ("wquince", "wmedlar", "wloquat"):
            status, body = await call(
                stack, "POST", "/api/v1/add",
                json={"text": f"The orchard's {word} tree needs pruning in March", "user_id": user},
            )
            assert status == 200, body
            acked[word] = body["memory_id"]
        for _ in range(3):  # rows of many words: their keyword index takes about 230 KB
            words = " ".join("w" + uuid.uuid4().hex[:10] for _ in range(5000))
            status, body = await call(
                stack, "POST", "/api/v1/add", json={"text": words, "user_id": user}
            )
            assert status == 200, body
        stack.procs["store"].stop()
        # The keyword indexes gone (a store restarted builds them from the rows), and the disk
        # then filled but for 128 KB: room for SQLite's shared memory file, not for the indexes
        # (nor a reserve to let go: it went at an earlier start on the full disk).
        fill = (f'rm -r "$0/keywords" "$0/{RESERVE_NAME}"; cat /dev/zero > "$0/filler"; '
                'truncate -s -128K "$0/filler"')
        filled = await asyncio.to_thread(
            subprocess.run, [*on_disk, "sh", "-c", fill, str(data_dir)], capture_output=True
        )
        assert b"No space left on device" in filled.stderr, filled.stderr
        assert filled.returncode == 0, filled.stderr

        store = stack.start("store", wrapper=on_disk)
        assert "keyword index own could not be built" in store.logs()
        status, listed = await call(stack, "GET", "/api/v1/list", params={"user_id": user})
        assert status == 200, listed
        assert set(acked.values()) <= {m["memory_id"] for m in listed["memories"]}
        async with open_channel(stack.address("store")) as channel:
            got = await store_pb2_grpc.StoreStub(channel).GetMemories(
                store_pb2.GetMemoriesRequest(
                    scope=common_pb2.Scope(user_id=user), ids=list(acked.values())
                ),
                timeout=60,
            )
        assert [m.id for m in got.memories] == list(acked.values())
        status, found = await call(
            stack, "POST", "/api/v1/search",
            json={"query": "which orchard tree needs pruning", "user_id": user, "limit": 10},
        )
        assert status == 200, found
        hits = {item["memory_id"] for items in found["memories"].values() for item in items}
        assert set(acked.values()) <= hits
        assert await _keyword_found(stack, user, list(acked)) == {}
        # Said once, when the build was refused, not at each of the searches since.
        assert store.logs().count("keyword index own could not be built") == 1
        assert "keyword index own is not built" not in store.logs()

        # Room again: the next write builds the indexes.
        await asyncio.to_thread(
            subprocess.run, [*on_disk, "rm", str(data_dir / "filler")], check=True
        )
        status, body = await call(
            stack, "POST", "/api/v1/add", json={"text": "Room is back wagain", "user_id": user}
        )
        assert status == 200, body
        acked["wagain"] = body["memory_id"]

        async def all_found() -> None:
            assert await _keyword_found(stack, user, list(acked)) == acked

        await assert_eventually(all_found)


def _reserve_bytes(on_disk: tuple[str, ...], data_dir: Path) -> int | None:
    """The size of the store's disk reserve as the store sees its disk; None when missing."""
    seen = subprocess.run(
        [*on_disk, "stat", "-c", "%s", str(data_dir / RESERVE_NAME)], capture_output=True
    )
    return int(seen.stdout) if seen.returncode == 0 else None


async def test_a_store_restarted_on_a_disk_with_no_byte_free_lets_its_reserve_go_and_reads(
    tmp_path: Path, embedder_address: str
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    with _stack_on_small_disk(
        tmp_path, embedder_address, "8m", HYATLAS_STORE_SAVE_EVERY="1s"
    ) as (stack, on_disk, data_dir):
        status, body = await call(
            stack, "POST", "/api/v1/add",
            json={"text": "The spare key is under the blue pot", "user_id": user},
        )
        assert status == 200, body
        assert _reserve_bytes(on_disk, data_dir) == RESERVE_BYTES
        stack.procs["store"].stop()
        fill = [*on_disk, "sh", "-c", 'exec cat /dev/zero > "$0/filler"', str(data_dir)]
        filled = await asyncio.to_thread(subprocess.run, fill, capture_output=True)
        assert b"No space left on device" in filled.stderr

        store = stack.start("store", wrapper=on_disk)
        assert "let the 512 KiB reserve go" in store.logs()
        assert _reserve_bytes(on_disk, data_dir) is None
        status, listed = await call(stack, "GET", "/api/v1/list", params={"user_id": user})
        assert status == 200, listed
        assert [m["memory_id"] for m in listed["memories"]] == [body["memory_id"]]
        status, found = await call(
            stack, "POST", "/api/v1/search", json={"query": "where is the key", "user_id": user}
        )
        assert status == 200, found
        assert body["memory_id"] in {i["memory_id"] for v in found["memories"].values() for i in v}

        # Room again: the running store keeps a reserve again.
        await asyncio.to_thread(
            subprocess.run, [*on_disk, "rm", str(data_dir / "filler")], check=True
        )
        await assert_eventually(lambda: _reserve_bytes(on_disk, data_dir) == RESERVE_BYTES)


def test_a_store_without_a_reserve_that_cannot_open_its_database_on_a_full_disk_exits(
    tmp_path: Path, embedder_address: str
) -> None:
    """A data folder with no reserve (the disk filled before the store could keep one): SQLite
    cannot open it, and the store exits rather than hangs."""
    data_dir, address = tmp_path / "data", f"unix:{tmp_path / 'store.sock'}"
    data_dir.mkdir()
    env = base_env(data_dir, HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_STORE_ADDR=address)
    with _small_disk(data_dir, "size=8m") as on_disk:
        store = ServiceProcess(
            "services.store", env, lambda: grpc_serving(address), tmp_path / "store.log",
            wrapper=on_disk,
        )
        store.start()
        store.stop()
        # Not a byte free: SQLite cannot make the shared memory file of a database in WAL mode.
        fill = f'rm "$0/{RESERVE_NAME}" && exec cat /dev/zero > "$0/filler"'
        filled = subprocess.run([*on_disk, "sh", "-c", fill, str(data_dir)], capture_output=True)
        assert b"No space left on device" in filled.stderr
        with pytest.raises(RuntimeError, match="exited 1") as failed:
            store.start()
    assert "disk I/O error" in str(failed.value)


def _doctor(stack: Stack) -> subprocess.CompletedProcess[str]:
    """`hyatlas doctor` against the stack's gateway."""
    env = {**stack.env, "HYATLAS_SERVER_URL": stack.base_url}
    return subprocess.run(
        [sys.executable, "-m", "hyatlas_cli", "doctor"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


async def test_a_scheduled_snapshot_refused_by_a_full_disk_is_one_warning_fails_doctor_and_is_retried(  # noqa: E501
    tmp_path: Path, embedder_address: str
) -> None:
    folder = tmp_path / "snapshots"
    folder.mkdir()
    with _small_disk(folder, "size=16k") as on_disk, running_stack(
        tmp_path / "data", [], HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_SNAPSHOT_DIR=str(folder), HYATLAS_SNAPSHOT_EVERY="1s",
    ) as stack:
        # Both on the small disk: the gateway lists the snapshots the store writes there.
        store = stack.start("store", wrapper=on_disk)
        stack.start("search")
        stack.start("gateway", wrapper=on_disk)

        def refused_twice() -> None:
            assert store.logs().count('"msg": "snapshot failed, the disk is full (') >= 2

        await assert_eventually(refused_twice)
        assert "Traceback" not in store.logs()
        done = await asyncio.to_thread(_doctor, stack)
        assert done.returncode == 1, done.stdout
        assert "FAIL snapshots: the last scheduled snapshot failed at " in done.stdout
        assert ": the disk is full; next try at " in done.stdout

        grow = [*on_disk, "mount", "-o", "remount,size=64m", str(folder)]
        await asyncio.to_thread(subprocess.run, grow, check=True)

        async def doctor_content() -> None:
            done = await asyncio.to_thread(_doctor, stack)
            assert done.returncode == 0, done.stdout
            assert "ok   snapshots: newest hyatlas-" in done.stdout

        await assert_eventually(doctor_content)
