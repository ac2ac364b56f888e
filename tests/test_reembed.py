"""Re-embed: a store moves to another model, killed midway, and searches well before and after."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest

from services.embedder.config import EmbedderConfig
from services.embedder.derive import derive_fp16
from services.embedder.models import MINILM, MINILM_FP16
from services.embedder.server import running_server
from services.store import reembed
from services.store.config import StoreConfig
from services.store.index import VectorIndexes
from services.store.model import Insert, ListQuery, Reach
from services.store.reembed import Progress
from services.store.server import running_store
from services.store.servicer import StoreServicer
from shared.clients import EmbedderClient
from shared.errors import ConfigError, Conflict, Unavailable
from shared.passages import Passage
from shared.pb import common_pb2, embedder_pb2, embedder_pb2_grpc, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from tests.store_state import LONG_TEXT, call, store_config
from tests.support import (
    ROOT,
    WAIT_CEILING_S,
    Stack,
    assert_eventually,
    running_stack,
    value_eventually,
)

pytestmark = pytest.mark.slow

# Each target is found by a query that shares no word with it: only its vector can find it.
TARGETS = {
    "I drink green tea every morning.": "which hot beverage do I have at breakfast",
    "My dentist appointment is on Tuesday at nine.": "when do I see the doctor for my teeth",
    LONG_TEXT: "who decorated the walls in each bedroom",
}
LATE = ("I keep my bicycle in the garden shed.", "where is my bike stored")
FILLERS = 160
OPS, ALICE_APP = "reembed-ops-0123456789", "reembed-alice-app-0123456789"  # alice's: one owner


def test_derive_help_prints_usage_and_writes_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.embedder.derive", "--help"],
        cwd=tmp_path, env={"PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "out_dir" in done.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def fp16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 in half precision, built from the packaged int8 model."""
    return derive_fp16(tmp_path_factory.mktemp("fp16"))


def _fillers(user: str) -> str:
    colours = ["red", "amber", "teal", "grey", "violet"]
    nouns = ["electricity", "water", "phone", "insurance", "rent", "parking"]
    lines = [
        {
            "type": "memory",
            "memory": {
                "user_id": user,
                "content": f"Folder {i} is {colours[i % 5]} and holds the "
                f"{nouns[i % 6]} invoices from year {1990 + i}.",
            },
        }
        for i in range(FILLERS)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines)


async def _status(stack: Stack) -> dict[str, Any]:
    code, body = await call(stack, "GET", "/api/v1/status")
    assert code == 200, body
    return dict(body)


async def _add(stack: Stack, user: str, text: str) -> str:
    code, body = await call(stack, "POST", "/api/v1/add", json={"text": text, "user_id": user})
    assert code == 200, body
    return str(body["memory_id"])


async def _top_hit(stack: Stack, user: str, query: str) -> tuple[str, str]:
    """The first vector hit for a query and the model its vector came from, through the
    embedder's served model and the store's vector search (what the search service does)."""
    async with (
        open_channel(stack.address("embedder")) as embedder_channel,
        open_channel(stack.address("store")) as store_channel,
    ):
        vectors, model_id = await EmbedderClient(embedder_channel).embed([query], is_query=True)
        reply = await store_pb2_grpc.StoreStub(store_channel).VectorSearch(
            store_pb2.VectorSearchRequest(
                scope=common_pb2.Scope(user_id=user),
                vector=vectors[0].tolist(),
                model_id=model_id,
                k=3,
            ),
            timeout=60,
        )
    assert reply.hits, query
    return reply.hits[0].memory.id, model_id


async def _searched(stack: Stack, user: str, query: str) -> list[str]:
    """The ids the search route answers a query with, best first."""
    code, body = await call(
        stack, "POST", "/api/v1/search", json={"query": query, "user_id": user, "limit": 5}
    )
    assert code == 200, body
    return [m["memory_id"] for items in body["memories"].values() for m in items]


def _model_columns(db_path: Path) -> dict[str, set[str]]:
    """The model ids each table's vectors carry, and what a re-embed left staged."""
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as db:
        read = lambda sql: {str(r[0]) for r in db.execute(sql)}  # noqa: E731
        return {
            "vectors": read("SELECT DISTINCT model_id FROM vectors"),
            "clause keys": read(
                "SELECT DISTINCT model_id FROM memory_keys WHERE vector IS NOT NULL"
            ),
            "rows": read("SELECT DISTINCT model_id FROM memories"),
            "staged": read("SELECT memory_id FROM reembed_vectors"),
        }


def _persisted(db_path: Path) -> tuple[int, int]:
    """The staged rows and the cursor a killed re-embed left in SQLite."""
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as db:
        staged = db.execute("SELECT count(*) FROM reembed_vectors").fetchone()[0]
        cursor = db.execute(
            "SELECT value FROM store_meta WHERE key = ?", (reembed.META_CURSOR,)
        ).fetchone()
    return int(staged), int(cursor[0]) if cursor else 0


def _reembed_command(stack: Stack, token: str) -> dict[str, Any]:
    """How `hyatlas reembed` is run against the stack, as subprocess arguments."""
    return {
        "args": [sys.executable, "-m", "hyatlas_cli", "reembed", "--every", "0.2"],
        "cwd": ROOT,
        "env": {**stack.env, "HYATLAS_SERVER_URL": stack.base_url, "HYATLAS_TOKEN": token},
    }


def _hyatlas_reembed(stack: Stack, token: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        **_reembed_command(stack, token), capture_output=True, text=True, timeout=600
    )


@contextlib.contextmanager
def _following_reembed(stack: Stack, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`hyatlas reembed` running in the background, its stderr in log; killed if the block
    ends before it does."""
    with log.open("wb") as stderr:
        follower = subprocess.Popen(
            **_reembed_command(stack, ""), stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        yield follower
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.wait()


def _says(follower: subprocess.Popen[bytes], log: Path, words: str) -> Callable[[], None]:
    """A check that the follower wrote words, which fails at once if it exited without them."""

    def check() -> None:
        said = log.read_text(errors="replace")
        if words not in said and follower.poll() is not None:
            raise RuntimeError(f"hyatlas reembed exited {follower.returncode}: {said}")
        assert words in said

    return check


async def test_a_reembed_killed_midway_resumes_switches_and_searches_with_the_new_model(
    tmp_path: Path, fp16_dir: Path
) -> None:
    data_dir, user = tmp_path / "data", f"user-{uuid.uuid4().hex[:8]}"
    with running_stack(
        data_dir,
        ["embedder", "store", "search", "gateway"],
        # Paced so the rebuild lasts long enough to be seen (and killed) midway.
        HYATLAS_REEMBED_BATCH="4",
        HYATLAS_REEMBED_ROWS_PER_S="15",
    ) as stack, contextlib.ExitStack() as cleanup:
        code, body = await call(stack, "POST", "/api/v1/import", data=_fillers(user))
        assert code == 200, body
        ids = {text: await _add(stack, user, text) for text in TARGETS}
        for text, query in TARGETS.items():
            assert await _top_hit(stack, user, query) == (ids[text], MINILM.model_id)

        # The user points the embedder at another model and restarts.
        stack.procs["store"].stop()
        stack.procs["embedder"].stop()
        stack.env["HYATLAS_MODEL_DIR"] = str(fp16_dir)
        stack.start("embedder")
        stack.start("store")

        async def midway() -> dict[str, Any]:
            job = (await _status(stack)).get("reembed")
            assert job is not None and job["to_model"] == MINILM_FP16.model_id
            assert 8 <= job["done"] < job["total"], job
            return dict(job)

        await value_eventually(midway)
        # `hyatlas reembed` follows it from here on, through the store's crash below.
        follow_log = tmp_path / "follow.log"
        follower = cleanup.enter_context(_following_reembed(stack, follow_log))
        await assert_eventually(_says(follower, follow_log, f"re-embed to {MINILM_FP16.model_id}"))
        # Searches still answer from the old vectors, with queries of the old model.
        state = await _status(stack)
        assert state["embed"] == MINILM.model_id
        for text, query in TARGETS.items():
            assert await _top_hit(stack, user, query) == (ids[text], MINILM.model_id)
            assert (await _searched(stack, user, query))[0] == ids[text]
        late = await _add(stack, user, LATE[0])

        # An embedder killed and back serves its configured model until the store tells it
        # again which one searches need.
        stack.procs["embedder"].kill()
        stack.start("embedder")

        async def old_model_served() -> None:
            for text, query in TARGETS.items():
                try:
                    assert await _top_hit(stack, user, query) == (ids[text], MINILM.model_id)
                except grpc.aio.AioRpcError as exc:  # the store refuses the wrong model's query
                    raise AssertionError(exc.details()) from exc

        await assert_eventually(old_model_served)
        stack.procs["store"].kill()
        # The gateway answers 503 while the store is away: the follower waits, and says so.
        await assert_eventually(_says(follower, follow_log, "asking again in"))
        assert "HTTP 503: " in follow_log.read_text()
        staged, cursor = _persisted(data_dir / "hyatlas.db")
        assert staged > 0 and cursor > 0
        stack.start("store")
        # The gateway's channel to the store connects again after its backoff.
        job = (await value_eventually(lambda: _status(stack))).get("reembed")
        if job is not None:  # what was staged before the kill is kept, not made again
            assert job["done"] >= staged

        assert await asyncio.to_thread(follower.wait, 600) == 0, follow_log.read_text()
        assert f"searches use {MINILM_FP16.model_id}" in follow_log.read_text()

        state = await _status(stack)
        assert state["embed"] == MINILM_FP16.model_id and "reembed" not in state
        for text, query in {**TARGETS, LATE[0]: LATE[1]}.items():
            expected = ids.get(text, late)
            assert await _top_hit(stack, user, query) == (expected, MINILM_FP16.model_id)
            assert (await _searched(stack, user, query))[0] == expected
        assert _model_columns(data_dir / "hyatlas.db") == {
            "vectors": {MINILM_FP16.model_id},
            "clause keys": {MINILM_FP16.model_id},
            "rows": {MINILM_FP16.model_id},
            "staged": set(),
        }
        folder = data_dir / "vectors"
        assert (folder / reembed.MODEL_MARKER).read_text() == MINILM_FP16.model_id
        assert not folder.with_name("vectors.next").exists()

        # A restart keeps the new model: nothing is re-embedded again.
        stack.procs["store"].stop()
        stack.start("store")
        assert "reembed" not in await _status(stack)
        assert await _top_hit(stack, user, LATE[1]) == (late, MINILM_FP16.model_id)


async def test_a_token_reaching_some_owners_sees_a_reembed_run_and_follows_it_without_counts(
    tmp_path: Path, fp16_dir: Path
) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{
        "name": "alice-app", "token": ALICE_APP, "users": ["alice"], "agents": ["*"],
        "scopes": ["read", "write"],
    }]}))
    ops, alice = ({"Authorization": f"Bearer {token}"} for token in (OPS, ALICE_APP))
    with running_stack(
        tmp_path / "data",
        ["embedder", "store", "gateway"],
        HYATLAS_REEMBED_BATCH="4",
        HYATLAS_REEMBED_ROWS_PER_S="15",
        HYATLAS_TOKENS_FILE=str(tokens),
        HYATLAS_TOKEN=OPS,
    ) as stack:
        code, body = await call(
            stack, "POST", "/api/v1/import", data=_fillers("alice"), headers=ops
        )
        assert code == 200, body
        stack.procs["store"].stop()
        stack.procs["embedder"].stop()
        stack.env["HYATLAS_MODEL_DIR"] = str(fp16_dir)
        stack.start("embedder")
        stack.start("store")

        async def running() -> None:
            code, body = await call(stack, "GET", "/api/v1/status", headers=alice)
            assert code == 200, body
            # That it runs and to which model; its counts are the whole store's.
            assert body["reembed"]["to_model"] == MINILM_FP16.model_id
            assert set(body["reembed"]) == {"to_model", "state"}

        await assert_eventually(running)
        shown = await asyncio.to_thread(_hyatlas_reembed, stack, ALICE_APP)
    assert shown.returncode == 0, shown.stderr
    assert "nothing to re-embed" not in shown.stderr
    assert "the re-embed's counts (the whole store's) are not shown" in shown.stderr
    assert f"re-embed to {MINILM_FP16.model_id}" in shown.stderr
    assert f"re-embedded: searches use {MINILM_FP16.model_id}" in shown.stderr


async def test_the_rows_done_of_a_reembed_never_go_back_not_even_while_it_switches(
    tmp_path: Path, embedder_address: str, fp16_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir, alice = tmp_path / "data", Reach(("alice",))
    async with running_store(store_config(data_dir, embedder_address)) as store:
        rows = [Insert("alice", "", "", "l3_fact", f"Alice keeps {n} hives.") for n in range(5)]
        await store.apply(alice, rows)
    # The switch is held once its transaction is committed, before the folder is swapped in.
    swapping, swap = threading.Event(), threading.Event()
    real_swap_in = reembed.swap_in

    def held_swap_in(folder: Path) -> None:
        swapping.set()
        swap.wait(WAIT_CEILING_S)
        real_swap_in(folder)

    monkeypatch.setattr(reembed, "swap_in", held_swap_in)
    config = EmbedderConfig(address=f"unix:{tmp_path / 'e.sock'}", model_dir=fp16_dir)
    seen: list[Progress] = []

    async def switching() -> None:
        progress = await store.reembed_progress()
        assert progress is not None
        seen.append(progress)
        assert swapping.is_set() and progress.state == "switching"

    async with (
        running_server(config) as embedder,
        running_store(store_config(data_dir, embedder.address)) as store,
    ):
        try:
            await assert_eventually(switching)
        finally:
            swap.set()
        await assert_eventually(lambda: store.reembed is not None and store.reembed.state == "done")
    assert seen[-1].done == seen[-1].total == 5, seen[-1]
    assert [p.done for p in seen] == sorted(p.done for p in seen), seen

async def test_hyatlas_reembed_says_when_there_is_nothing_to_do(
    tmp_path: Path, embedder_address: str
) -> None:
    with running_stack(
        tmp_path / "data", ["store", "gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address
    ) as stack:
        shown = await asyncio.to_thread(_hyatlas_reembed, stack)
    assert shown.returncode == 0, shown.stderr
    assert f"nothing to re-embed: every vector is of {MINILM.model_id}" in shown.stderr


async def test_the_embedder_runs_a_named_model_beside_its_configured_one(
    tmp_path: Path, fp16_dir: Path
) -> None:
    config = EmbedderConfig(address=f"unix:{tmp_path / 'e.sock'}", model_dir=fp16_dir)
    async with running_server(config) as running, open_channel(running.address) as channel:
        stub = embedder_pb2_grpc.EmbedderStub(channel)
        served = await stub.DescribeModel(embedder_pb2.DescribeModelRequest())
        assert (served.model_id, served.configured_model_id) == (MINILM_FP16.model_id,) * 2

        texts = ["The kettle is on the stove."]
        old = await stub.Embed(embedder_pb2.EmbedRequest(texts=texts, model_id=MINILM.model_id))
        new = await stub.Embed(embedder_pb2.EmbedRequest(texts=texts))
        assert (old.model_id, new.model_id) == (MINILM.model_id, MINILM_FP16.model_id)
        assert old.vectors[0].values != new.vectors[0].values

        await stub.ServeModel(embedder_pb2.ServeModelRequest(model_id=MINILM.model_id))
        assert (await stub.Embed(embedder_pb2.EmbedRequest(texts=texts))).model_id == (
            MINILM.model_id
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ServeModel(embedder_pb2.ServeModelRequest(model_id="no-such-model"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no-such-model" in (refused.value.details() or "")
        # Serving the configured model again lets the other one go.
        await stub.ServeModel(embedder_pb2.ServeModelRequest(model_id=MINILM_FP16.model_id))
        assert (await stub.Embed(embedder_pb2.EmbedRequest(texts=texts))).model_id == (
            MINILM_FP16.model_id
        )


async def test_a_write_embedded_before_a_model_switch_is_refused_and_writes_nothing(
    tmp_path: Path, embedder_address: str
) -> None:
    async with running_store(store_config(tmp_path, embedder_address)) as store:
        core = store._core
        embedded = asyncio.Event()
        real_embed = core.embed

        async def embed_then_tell(passages: Sequence[Passage]) -> np.ndarray:
            vectors = await real_embed(passages)
            embedded.set()
            return vectors

        core.embed = embed_then_tell  # type: ignore[method-assign]
        row = Insert("alice", "", "", "l3_fact", "Alice keeps bees on the roof.")
        async with core.write_lock:  # held by a re-embed's switch
            write = asyncio.create_task(store.apply(Reach(("alice",)), [row]))
            await asyncio.wait_for(embedded.wait(), WAIT_CEILING_S)
            core.model = dataclasses.replace(core.model, model_id="the-next-model")
        with pytest.raises(Unavailable, match="send it again"):
            await write
        page = await store.list_rows(Reach(("alice",)), ListQuery())
        assert page.rows == [] and page.total == 0
        assert (await store.stats(Reach(("alice",)))).vectors == 0


async def test_vectors_embedded_ahead_for_an_import_name_the_model_that_made_them(
    tmp_path: Path, embedder_address: str
) -> None:
    async with running_store(store_config(tmp_path, embedder_address)) as store:
        core = store._core
        made_with = core.model.model_id
        real_embed = core.embed

        async def embed_then_switch(passages: Sequence[Passage], *, bulk: bool) -> np.ndarray:
            vectors = await real_embed(passages, bulk=bulk)
            # A re-embed's switch lands once the vectors are made, before they are sent.
            core.model = dataclasses.replace(core.model, model_id="the-next-model")
            return vectors

        core.embed = embed_then_switch  # type: ignore[method-assign]
        line = {"type": "memory", "memory": {"user_id": "alice", "content": "Alice keeps bees."}}
        request = store_pb2.ImportRowsRequest(
            scope=common_pb2.Scope(all_users=True),
            lines=[store_pb2.ImportLine(line=1, json=json.dumps(line))],
        )
        reply = await StoreServicer(store).EmbedImport(request, cast(Any, None))
        assert (reply.rows, reply.model_id) == (1, made_with)


async def test_a_vector_search_overtaken_by_a_model_switch_is_refused(
    tmp_path: Path, embedder_address: str
) -> None:
    async with running_store(store_config(tmp_path, embedder_address)) as store:
        core = store._core
        alice = Reach(("alice",))
        await store.apply(alice, [Insert("alice", "", "", "l3_fact", "Alice keeps bees.")])
        [query] = (await core.embed([Passage("who keeps bees")]))[:1]
        assert isinstance(core.indexes, VectorIndexes)
        indexes, real_search = core.indexes, core.indexes.search
        waiting = asyncio.Event()

        async def tell_then_search(*args: Any) -> Any:
            waiting.set()
            return await real_search(*args)

        indexes.search = tell_then_search  # type: ignore[method-assign,assignment]
        model = core.model
        async with indexes.switching(model.ndim):  # a re-embed's swap, to a model alike
            search = asyncio.create_task(store.vector_search(alice, query, model.model_id))
            await asyncio.wait_for(waiting.wait(), WAIT_CEILING_S)  # checked, now waits
            core.model = dataclasses.replace(model, model_id="the-next-model")
        with pytest.raises(Conflict, match="the-next-model"):
            await search


def _folder(path: Path, marker: str | None) -> Path:
    path.mkdir()
    (path / "index.usearch").write_text(path.name)
    if marker is not None:
        (path / reembed.MODEL_MARKER).write_text(marker)
    return path


@pytest.mark.parametrize(
    ("next_marker", "live_marker", "kept"),
    [
        ("new", None, "vectors.next"),  # the switch committed, the swap did not happen
        ("new", "old", "vectors.next"),
        (None, None, "vectors"),  # the build was cut short: its folder is dropped
        ("other", None, "vectors"),
    ],
)
def test_a_crash_mid_switch_leaves_the_index_folder_of_the_committed_model(
    tmp_path: Path, next_marker: str | None, live_marker: str | None, kept: str
) -> None:
    live = _folder(tmp_path / "vectors", live_marker)
    _folder(tmp_path / "vectors.next", next_marker)
    _folder(tmp_path / "vectors.old", "old")
    reembed.settle_index_folders(live, "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vectors"]
    assert (live / "index.usearch").read_text() == kept


def test_a_live_index_folder_of_another_model_is_dropped(tmp_path: Path) -> None:
    live = _folder(tmp_path / "vectors", "old")
    reembed.settle_index_folders(live, "new")
    assert not live.exists()


@pytest.mark.parametrize(
    ("name", "value"),
    [("HYATLAS_REEMBED_ROWS_PER_S", "fast"), ("HYATLAS_REEMBED_ROWS_PER_S", "-3"),
     ("HYATLAS_REEMBED_BATCH", "0")],
)
def test_a_bad_reembed_setting_names_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        StoreConfig.from_env({"HYATLAS_GO_DATA": "/tmp/x", name: value})


def test_reembed_settings_are_read() -> None:
    config = StoreConfig.from_env(
        {"HYATLAS_REEMBED_BATCH": "8", "HYATLAS_REEMBED_ROWS_PER_S": "off"}
    )
    assert (config.reembed.batch, config.reembed.rows_per_s) == (8, None)
