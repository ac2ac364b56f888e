"""Export and import over real HTTP: a store moved to a fresh data directory comes back whole."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest

from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from tests.store_state import LAYERS, LONG_TEXT, call, export, observed, seed, vector_line
from tests.support import WAIT_CEILING_S, Stack, assert_eventually, running_stack
from tests.test_store import raises_code

pytestmark = pytest.mark.slow

def _stack(tmp_path_factory: pytest.TempPathFactory, name: str, embedder: str) -> Any:
    return running_stack(
        tmp_path_factory.mktemp(name),
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder,
        HYATLAS_ADMIN="on",
    )


@pytest.fixture(scope="module")
def source(
    tmp_path_factory: pytest.TempPathFactory, embedder_address: str, store_backend: str
) -> Iterator[Stack]:
    # store_backend: one source a backend (the module runs on each in turn).
    with _stack(tmp_path_factory, f"transfer-source-{store_backend}", embedder_address) as stack:
        yield stack


@pytest.fixture
def target(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    with _stack(tmp_path_factory, "transfer-target", embedder_address) as stack:
        yield stack


async def _import(stack: Stack, lines: list[Any] | bytes, **params: str) -> tuple[int, Any]:
    body = lines if isinstance(lines, bytes) else "".join(json.dumps(x) + "\n" for x in lines)
    data = io.BytesIO(body if isinstance(body, bytes) else body.encode())
    return await call(stack, "POST", "/api/v1/import", data=data, params=params)


async def test_round_trip_to_a_fresh_data_dir_gives_the_same_store(
    source: Stack, target: Stack
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    ids = await seed(source, user)
    exported = await export(source)
    head, lines = exported[0], exported[1:-1]
    assert head["format"] == "hyatlas-export" and head["version"] == 1 and head["ndim"] == 384
    assert exported[-1] == {"type": "end", "lines": len(exported) - 1}
    memories = [line for line in lines if line["type"] == "memory"]
    assert {m["memory"]["layer"] for m in memories} == set(LAYERS)
    assert [line["type"] for line in lines].count("edge") == 1
    restored = next(m for m in memories if m["memory"]["id"] == ids["restored"])
    assert [e["action"] for e in restored["history"]] == ["insert", "retire", "restore"]
    long_turn = next(m for m in memories if m["memory"]["content"] == LONG_TEXT)
    assert {k["kind"] for k in long_turn["keys"]} == {"clause", "context"}
    # The intention learnt from the dentist turn (retired, then restored) is a key of it.
    dentist_turn = next(m for m in memories if m["memory"]["id"] == ids["dentist_turn"])
    (fact_key,) = [k for k in dentist_turn["keys"] if k["kind"] == "fact"]
    assert fact_key["text"] == "Call the dentist again" and fact_key["vector"]
    vector = np.frombuffer(base64.b64decode(long_turn["vector"]), dtype="<f4")
    # A unit vector, as the store keeps it: 8 bits a component (within a thousandth).
    assert vector.shape == (384,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-3

    status, reply = await _import(target, exported)
    assert status == 200, reply
    assert reply == {
        "lines": len(lines),
        "imported": len(lines),
        "skipped": 0,
        "refused": 0,
        "errors": [],
        "stopped": False,
        "complete": True,  # the end line came, and is no memory
    }
    seen = await observed(source, user)
    assert all(any(channels.values()) for channels in seen["hits"].values())
    assert seen["edges"]["knowledge"]
    assert len(seen["list"]["memories"]) == seen["list"]["total"] > 10
    assert await observed(target, user) == seen
    again = await export(target)
    assert again[1:] == exported[1:]  # every field, vector, key and audit entry, in the same order

    status, twice = await _import(target, exported)
    assert status == 200, twice
    assert (twice["imported"], twice["skipped"]) == (0, len(lines))
    assert (await export(target))[1:-1] == lines


async def test_a_turn_of_the_longest_text_comes_back_with_its_context_key(
    source: Stack, target: Stack
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    longest = " ".join(["word"] * 20_000)[: 100_000]
    for text in ("The turn before it.", longest, "The turn after it."):
        status, body = await call(source, "POST", "/api/v1/add",
                                  json={"text": text, "user_id": user, "session_id": "s"})
        assert status == 200, body
    exported = await export(source, user_id=user)
    (turn,) = [m for m in exported[1:-1] if m["memory"]["content"] == longest]
    (context,) = [k for k in turn["keys"] if k["kind"] == "context"]
    assert len(context["text"]) > len(longest)  # the neighbours' lines around it
    status, reply = await _import(target, exported)
    assert (status, reply["imported"], reply["refused"]) == (200, 3, 0), reply


async def test_a_bad_line_is_refused_with_its_number_and_the_good_lines_are_written(
    target: Stack,
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    good = [{"type": "memory", "memory": {"user_id": user, "content": f"The boat is {colour}."}}
            for colour in ("blue", "red")]
    bad_layer = {"type": "memory", "memory": {"user_id": user, "content": "x", "layer": "l9"}}
    body = (
        json.dumps(good[0]) + "\n\n" + json.dumps(bad_layer) + "\n{not json\n"
        + json.dumps(good[1])
    ).encode()
    status, reply = await _import(target, body)
    assert status == 400, reply
    assert [e["line"] for e in reply["errors"]] == [3, 4]
    assert "memory.layer 'l9'" in reply["errors"][0]["error"]
    assert reply["error"].startswith("line 3: ")
    assert (reply["lines"], reply["imported"], reply["refused"]) == (4, 2, 2)
    status, listing = await call(target, "POST", "/api/v1/list", json={"user_id": user})
    assert listing["total"] == 2


async def test_a_line_with_a_lone_surrogate_is_refused_with_its_number_and_the_rest_written(
    target: Stack,
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    good = json.dumps({"type": "memory", "memory": {"user_id": user, "content": "Fine."}})
    bad = good.replace("Fine.", "a\\ud800b")  # a \\u escape: json.dumps would double it
    status, reply = await _import(target, (good + "\n" + bad + "\n").encode())
    assert status == 400, reply
    assert reply["error"] == "line 2: line.memory.content is not valid Unicode (a lone surrogate)"
    assert (reply["lines"], reply["imported"], reply["refused"]) == (2, 1, 1)
    status, listing = await call(target, "POST", "/api/v1/list", json={"user_id": user})
    assert listing["total"] == 1


async def test_every_good_line_of_a_batch_with_a_bad_one_is_written_and_every_line_counted(
    target: Stack,
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    lines = [json.dumps({"type": "memory", "memory": {"user_id": user, "content": f"Note {n}."}})
             for n in range(1, 1201)]
    lines[699] = "{not json"
    status, reply = await _import(target, ("\n".join(lines) + "\n").encode())
    assert status == 400, reply
    assert [e["line"] for e in reply["errors"]] == [700]
    assert (reply["lines"], reply["imported"], reply["skipped"], reply["refused"]) == (
        1200, 1199, 0, 1
    )
    status, listing = await call(target, "POST", "/api/v1/list",
                                 json={"user_id": user, "limit": 1})
    assert listing["total"] == 1199


async def test_a_line_that_is_not_utf8_is_counted_refused_and_its_batch_written(
    target: Stack,
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    good = [json.dumps({"type": "memory", "memory": {"user_id": user, "content": f"Fine {n}."}})
            for n in range(3)]
    body = (good[0] + "\n" + good[1] + "\n").encode() + b"\xff\xfe\n" + good[2].encode() + b"\n"
    status, reply = await _import(target, body)
    assert status == 400, reply
    assert reply["errors"] == [{"line": 3, "error": "not UTF-8 text"}]
    assert (reply["lines"], reply["imported"], reply["refused"]) == (4, 3, 1)
    status, listing = await call(target, "POST", "/api/v1/list", json={"user_id": user})
    assert listing["total"] == 3


async def test_a_name_with_whitespace_around_it_is_refused_as_the_api_could_not_reach_it(
    target: Stack,
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    lines = [
        {"type": "memory", "memory": {"user_id": f" {user} ", "content": "Padded owner."}},
        {"type": "memory", "memory": {"user_id": user, "agent_id": "bot\t", "content": "Agent."}},
        {"type": "memory", "memory": {"id": " spaced ", "user_id": user, "content": "Padded id."}},
        {"type": "memory", "memory": {"user_id": user, "content": "Fine."}},
    ]
    status, reply = await _import(target, lines)
    assert status == 400, reply
    assert [e["line"] for e in reply["errors"]] == [1, 2, 3]
    assert all("whitespace around it" in e["error"] for e in reply["errors"]), reply
    status, listing = await call(target, "POST", "/api/v1/list", json={"user_id": user})
    assert [row["content"] for row in listing["memories"]] == ["Fine."]


async def test_refusals_are_listed_and_named_in_line_order(target: Stack) -> None:
    # The store refuses lines 1-2 after the gateway refused lines 3-4 as it read them.
    body = b"{not json\n" * 2 + b"\xff\n" * 2
    status, reply = await _import(target, body)
    assert status == 400, reply
    assert [e["line"] for e in reply["errors"]] == [1, 2, 3, 4]
    assert reply["error"].startswith("line 1: ")


async def test_a_header_of_another_format_is_refused_and_changes_nothing(target: Stack) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    line = {"type": "memory", "memory": {"user_id": user, "content": "Some text."}}
    # Until 2026-12-08 a version of true or 1.0 passed as 1 (True == 1.0 == 1 in Python).
    for version, said in ((3, "3"), (True, "true"), (1.0, "1.0")):
        head = {"format": "hyatlas-export", "version": version}
        status, reply = await _import(target, [head, line])
        assert status == 400 and reply["error"] == f"export version {said} is not 1 or 2"
    status, listing = await call(target, "POST", "/api/v1/list", json={"user_id": user})
    assert listing["total"] == 0


async def test_an_edge_sharing_a_memorys_id_is_imported_not_skipped(target: Stack) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    first, second = f"{user}-a", f"{user}-b"

    def memory(memory_id: str) -> dict[str, Any]:
        return {"type": "memory", "memory": {"user_id": user, "content": "Ana paints.",
                                             "id": memory_id}}

    def edge(edge_id: str) -> dict[str, Any]:
        return {"type": "edge", "edge": {"user_id": user, "id": edge_id, "subject": "Ana",
                                         "relation": "paints", "object": edge_id}}

    status, reply = await _import(target, [memory(first), edge(first)])  # in one batch
    assert status == 200 and (reply["imported"], reply["skipped"]) == (2, 0), reply
    status, reply = await _import(target, [memory(second)])
    assert status == 200 and reply["imported"] == 1, reply
    status, reply = await _import(target, [edge(second)])  # the memory is in the store
    assert status == 200 and (reply["imported"], reply["skipped"]) == (1, 0), reply
    exported = await export(target, user_id=user)
    assert sorted(line["edge"]["id"] for line in exported if line.get("type") == "edge") == [
        first, second
    ]


async def test_an_id_another_owner_holds_is_refused_and_one_its_owner_holds_is_skipped(
    target: Stack,
) -> None:
    alice, bob = f"user-{uuid.uuid4().hex[:8]}", f"user-{uuid.uuid4().hex[:8]}"
    taken, fresh = f"{alice}-m", f"{bob}-m"

    def memory(memory_id: str, user: str, agent: str = "", text: str = "Ana paints.") -> Any:
        return {"type": "memory", "memory": {"user_id": user, "agent_id": agent,
                                             "content": text, "id": memory_id}}

    def edge(edge_id: str, user: str) -> dict[str, Any]:
        return {"type": "edge", "edge": {"user_id": user, "id": edge_id, "subject": "Ana",
                                         "relation": "paints", "object": "walls"}}

    status, reply = await _import(target, [memory(taken, alice), edge(taken, alice)])
    assert status == 200 and reply["imported"] == 2, reply
    before = await export(target, user_id=alice)
    status, reply = await _import(target, [
        memory(taken, bob, text="Bob's own text."),  # alice's row: refused
        edge(taken, bob),  # alice's edge: refused
        memory(taken, alice, agent="helper"),  # another agent of hers is another owner
        memory(taken, alice, text="Ana paints walls."),  # her row, edited since: skipped
        edge(taken, alice),  # her edge: skipped
        memory(fresh, bob),
        memory(fresh, alice),  # the line before gave the id to bob: refused
    ])
    assert status == 400, reply
    assert reply["errors"] == [
        {"line": 1, "error": f"id {taken!r} is taken by another memory"},
        {"line": 2, "error": f"id {taken!r} is taken by another edge"},
        {"line": 3, "error": f"id {taken!r} is taken by another memory"},
        {"line": 7, "error": f"id {fresh!r} is taken by another memory"},
    ]
    assert (reply["lines"], reply["imported"], reply["skipped"], reply["refused"]) == (
        7, 1, 2, 4
    )
    assert (await export(target, user_id=alice))[1:] == before[1:]
    mine = await export(target, user_id=bob)
    assert [line["memory"]["id"] for line in mine[1:-1]] == [fresh]


def _bare(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Export lines without their vectors (a row's text settles its vector)."""
    bare = json.loads(json.dumps(lines))
    for line in bare:
        for holder in [line, *line.get("keys", [])]:
            holder.pop("vector", None)
    return bare


def _line_of(lines: list[dict[str, Any]], layer: str) -> dict[str, Any]:
    return next(line for line in lines if line.get("memory", {}).get("layer") == layer)


def _gone(kind: str, item_id: str, user: str) -> dict[str, Any]:
    return {"type": "gone", "gone": {"kind": kind, "id": item_id, "user_id": user}}


async def test_a_sync_import_replaces_what_changed_and_takes_away_what_is_gone_a_plain_one_not(
    source: Stack, target: Stack
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    await seed(source, user)
    lines = (await export(source, user_id=user))[1:-1]
    status, reply = await _import(target, lines)
    assert status == 200 and reply["imported"] == len(lines), reply
    changed = json.loads(json.dumps(lines))
    summary, schema = _line_of(changed, "l4_summary"), _line_of(changed, "l6_schema")
    summary["memory"].update(label="trips", hits=3, metadata={"x": 1})
    schema["memory"]["content"] = "l6_schema note: my favourite coffee is a flat white"
    schema["vector"] = None  # embedded by the import
    (edge,) = [line for line in changed if line["type"] == "edge"]
    edge["edge"].update(weight=0.5, invalidated_at=1_800_000_000.0)
    gone = [
        _gone("memory", summary["memory"]["id"], "someone-else"),  # not theirs: skipped
        _gone("memory", summary["memory"]["id"], user),
        _gone("edge", edge["edge"]["id"], user),
        _gone("memory", "no-such-row", user),  # nothing to take away: skipped
    ]

    # Without sync, a line whose id is held skips however it differs, and a gone line too.
    status, reply = await _import(target, changed + gone)
    assert status == 200 and (reply["imported"], reply["skipped"]) == (0, len(changed) + 4)
    assert "updated" not in reply
    assert _bare((await export(target, user_id=user))[1:-1]) == _bare(lines)

    status, reply = await _import(target, changed, sync="true")
    assert status == 200, reply
    assert (reply["imported"], reply["updated"], reply["erased"], reply["skipped"]) == (
        0, 3, 0, len(changed) - 3
    )
    assert _bare((await export(target, user_id=user))[1:-1]) == _bare(changed)
    status, body = await call(target, "POST", "/api/v1/search",
                              json={"query": "flat white coffee", "user_id": user, "limit": 3})
    assert status == 200, body
    found = [m["memory_id"] for items in body["memories"].values() for m in items]
    assert schema["memory"]["id"] in found

    status, reply = await _import(target, gone, sync="true")
    assert status == 200, reply
    assert (reply["erased"], reply["skipped"], reply["updated"]) == (2, 2, 0), reply
    kept = [line for line in changed if line not in (summary, edge)]
    assert _bare((await export(target, user_id=user))[1:-1]) == _bare(kept)


async def test_a_gone_line_under_a_version_1_header_is_refused_by_line_and_takes_nothing(
    target: Stack,
) -> None:
    # Until 2026-12-07 a gone line was applied under any header: a version-1 file (an export
    # without gone lines) with one deleted its row for good under sync=true.
    user = f"user-{uuid.uuid4().hex[:8]}"
    kept = {"type": "memory", "memory": {"user_id": user, "id": f"{user}-m", "content": "Ana."}}
    status, reply = await _import(target, [kept])
    assert status == 200 and reply["imported"] == 1, reply
    version_1 = {"format": "hyatlas-export", "version": 1}
    later = {"type": "memory", "memory": {"user_id": user, "content": "Ana paints."}}
    status, reply = await _import(
        target, [version_1, _gone("memory", f"{user}-m", user), later], sync="true"
    )
    assert status == 400, reply
    assert reply["errors"] == [{"line": 2, "error": (
        "a gone line, but the header says version 1: an export with gone lines is version 2"
    )}]
    assert (reply["lines"], reply["imported"], reply["erased"], reply["refused"]) == (2, 1, 0, 1)
    assert reply["error"].startswith("line 2: a gone line")
    exported = await export(target, user_id=user)
    assert [line["memory"]["content"] for line in exported[1:-1]] == ["Ana.", "Ana paints."]


async def test_an_export_asked_for_gone_lines_ends_with_the_rows_deleted_for_good_since(
    source: Stack,
) -> None:
    user, other = f"user-{uuid.uuid4().hex[:8]}", f"user-{uuid.uuid4().hex[:8]}"
    await seed(source, user)
    await seed(source, other)
    summary = _line_of((await export(source, user_id=user))[1:-1], "l4_summary")
    status, body = await call(source, "POST", "/api/v1/delete_all",
                              json={"user_id": user, "id": summary["memory"]["id"]})
    assert status == 200, body
    exported = await export(source, user_id=user, gone="true")
    assert exported[-2] == {"type": "gone", "gone": {
        "kind": "memory", "id": summary["memory"]["id"], "user_id": user, "agent_id": ""}}
    assert exported[-1] == {"type": "end", "lines": len(exported) - 1}
    assert exported[1:-2] == (await export(source, user_id=user))[1:-1]
    assert all(line.get("type") != "gone" for line in await export(source, user_id=other,
                                                                    gone="true"))
    # An id a row holds again (imported back) is not gone.
    status, reply = await _import(source, [summary])
    assert status == 200 and reply["imported"] == 1, reply
    assert all(line.get("type") != "gone" for line in await export(source, user_id=user,
                                                                    gone="true"))


async def test_a_minimal_line_synced_changes_only_what_it_gives(target: Stack) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    memory_id = f"{user}-m"
    note = {"type": "memory", "memory": {"user_id": user, "id": memory_id, "label": "notes",
                                         "content": "A short note.", "layer": "l4_summary"}}
    edge = {"type": "edge", "edge": {"user_id": user, "id": f"{user}-e", "subject": "Ana",
                                     "relation": "paints", "object": "walls"}}
    status, reply = await _import(target, [note, edge])
    assert status == 200 and reply["imported"] == 2, reply
    before = (await export(target, user_id=user))[1:-1]
    # Again as it was: the times it leaves out are the stored ones, not now.
    status, reply = await _import(target, [note, edge], sync="true")
    assert status == 200 and (reply["skipped"], reply["updated"]) == (2, 0), reply
    longer = {"type": "memory", "memory": {"user_id": user, "id": memory_id, "content": LONG_TEXT}}
    status, reply = await _import(target, [longer], sync="true")
    assert status == 200 and reply["updated"] == 1, reply
    row, edge_after = (await export(target, user_id=user))[1:-1]
    assert edge_after == before[1]
    assert row["memory"] == {**before[0]["memory"], "content": LONG_TEXT}
    assert {key["kind"] for key in row["keys"]} == {"clause"}  # keys of the new text
    assert [(e["action"], e["reason"]) for e in row["history"]] == [
        ("insert", "import"), ("update", "import")]
    assert row["history"][1]["after"]["content"] == LONG_TEXT
    status, body = await call(target, "POST", "/api/v1/search",
                              json={"query": "farmhouse roof", "user_id": user, "limit": 3})
    assert status == 200, body
    assert memory_id in [m["memory_id"] for items in body["memories"].values() for m in items]


async def test_a_fact_retired_or_restored_by_a_synced_minimal_line_leaves_or_keys_its_turn(
    target: Stack,
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    turn = {"type": "memory", "memory": {"user_id": user, "id": f"{user}-t", "session_id": "s",
                                         "content": "I moved to Porto last spring."}}
    fact = {"type": "memory", "memory": {"user_id": user, "id": f"{user}-f", "layer": "l3_fact",
                                         "content": "The user lives in Porto.",
                                         "source_ids": [f"{user}-t"]}}
    dropped = {**fact, "memory": {**fact["memory"], "status": "retired",
                                  "superseded_how": "dropped", "invalid_at": 1_800_000_000.0}}
    live = {**fact, "memory": {**fact["memory"], "status": "active", "superseded_how": "",
                               "invalid_at": None}}

    async def turn_keys() -> list[tuple[str, str]]:
        line = (await export(target, user_id=user))[1]
        assert line["memory"]["id"] == f"{user}-t"
        return [(key["kind"], key["text"]) for key in line["keys"]]

    status, reply = await _import(target, [turn, fact])
    assert status == 200 and reply["imported"] == 2, reply
    assert ("fact", "The user lives in Porto.") in await turn_keys()
    for line, keyed in ((dropped, False), (live, True)):
        status, reply = await _import(target, [line], sync="true")
        assert status == 200 and reply["updated"] == 1, reply
        assert (("fact", "The user lives in Porto.") in await turn_keys()) is keyed


async def test_a_sync_import_refuses_another_row_under_a_held_id_and_a_bad_switch(
    target: Stack,
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    line = {"type": "memory", "memory": {"user_id": user, "id": f"{user}-m", "content": "Hi.",
                                         "layer": "l4_summary"}}
    status, reply = await _import(target, [line])
    assert status == 200 and reply["imported"] == 1, reply
    before = await export(target, user_id=user)
    other = {**line, "memory": {**line["memory"], "layer": "l3_fact", "content": "Bye."}}
    fresh = {"type": "memory", "memory": {"user_id": user, "content": "Also new.",
                                          "layer": "l4_summary"}}
    status, reply = await _import(target, [other, fresh], sync="true")
    assert status == 400, reply
    assert reply["errors"] == [{"line": 1, "error": (
        f"memory {user + '-m'!r} differs from the stored one in layer, which no change of a "
        "memory alters: it is not the same memory, and is not replaced"
    )}]
    assert (reply["imported"], reply["updated"], reply["refused"]) == (1, 0, 1), reply
    assert (await export(target, user_id=user))[1:-2] == before[1:-1]  # the new row came last

    for switch in ({"sync": "maybe"}, {"sync": ""}):
        status, reply = await _import(target, [other], **switch)
        assert status == 400 and "sync must be true or false" in reply["error"], reply
    status, reply = await call(target, "GET", "/api/v1/export",
                               params={"user_id": user, "gone": "perhaps"})
    assert status == 400 and "gone must be true or false" in reply["error"], reply
    assert (await export(target, user_id=user))[1:-2] == before[1:-1]


async def test_a_retired_line_without_how_or_replaced_by_itself_is_refused(
    target: Stack,
) -> None:
    alice = f"user-{uuid.uuid4().hex[:8]}"

    def row(memory_id: str, **fields: Any) -> Any:
        return {"type": "memory", "memory": {"user_id": alice, "id": memory_id,
                                             "content": f"Note {memory_id}", **fields}}

    status, reply = await _import(target, [
        row("r1", status="retired"),
        row("r2", status="retired", superseded_how="replaced", superseded_by="r2"),
        row("r3", status="retired", superseded_how="replaced", superseded_by="r4"),
        row("r4"),
    ])
    assert status == 400, reply
    assert [(e["line"], e["error"].split(":")[0]) for e in reply["errors"]] == [
        (1, "memory.superseded_how is required for a retired row"),
        (2, "memory.superseded_by names the row itself"),
    ]
    assert (reply["imported"], reply["refused"]) == (2, 2)


async def test_a_second_live_page_of_an_entity_or_now_page_is_refused_by_line(
    target: Stack,
) -> None:
    alice = f"user-{uuid.uuid4().hex[:8]}"

    def row(memory_id: str, layer: str, text: str, **fields: Any) -> Any:
        return {"type": "memory", "memory": {"user_id": alice, "id": memory_id,
                                             "layer": layer, "content": text, **fields}}

    def page(memory_id: str, name: str, **fields: Any) -> Any:
        return row(memory_id, "l8_entity", f"{name}: works at Acme",
                   metadata={"entity": name}, **fields)

    def now(memory_id: str, **fields: Any) -> Any:
        return row(memory_id, "l4_summary", "Now: moving house", label="now_page", **fields)

    status, reply = await _import(target, [page("p1", "Leo"), now("n1")])
    assert status == 200 and reply["imported"] == 2, reply
    status, reply = await _import(target, [
        page("p1", "Leo"),  # the same row again: skipped
        page("p2", "leo"),  # a second live page of Leo: refused
        page("p3", "Leo", status="retired", superseded_how="replaced"),  # retired: taken
        page("p4", "Mia"),
        page("p5", "Mia"),  # the line before is Mia's live page: refused
        now("n2"),  # a second live Now page: refused
        now("n3", status="retired", superseded_how="stale"),
    ])
    assert status == 400, reply
    assert [(e["line"], e["error"]) for e in reply["errors"]] == [
        (2, "memory 'p2' cannot be live: page 'p1' of its entity is live (an entity has one "
            "live page)"),
        (5, "memory 'p5' cannot be live: one on an earlier line is live"),
        (6, "memory 'n2' cannot be live: another Now page is live (one is live at a time)"),
    ]
    assert (reply["imported"], reply["skipped"], reply["refused"]) == (3, 1, 3)
    live = [line["memory"]["id"] for line in (await export(target, user_id=alice))[1:-1]
            if line["memory"]["status"] == "active"]
    assert sorted(live) == ["n1", "p1", "p4"]


async def test_a_batch_with_a_malformed_line_and_a_taken_id_writes_its_good_lines(
    target: Stack,
) -> None:
    # The store refuses the malformed line first and the taken id only once the rest is
    # well-formed: the batch goes again until it is taken.
    alice, bob = f"user-{uuid.uuid4().hex[:8]}", f"user-{uuid.uuid4().hex[:8]}"
    taken = f"{alice}-m"

    def memory(user: str, text: str, **fields: str) -> str:
        return json.dumps({"type": "memory", "memory": {"user_id": user, "content": text,
                                                        **fields}})

    status, reply = await _import(target, (memory(alice, "Ana paints.", id=taken) + "\n").encode())
    assert status == 200 and reply["imported"] == 1, reply
    body = "\n".join([
        memory(bob, "Good G."), "not json", memory(bob, "Bob's text.", id=taken),
        memory(bob, "Good H."),
    ]) + "\n"
    status, reply = await _import(target, body.encode())
    assert status == 400, reply
    assert [e["line"] for e in reply["errors"]] == [2, 3]
    assert reply["errors"][1]["error"] == f"id {taken!r} is taken by another memory"
    assert (reply["lines"], reply["imported"], reply["refused"]) == (4, 2, 2)
    status, listing = await call(target, "POST", "/api/v1/list", json={"user_id": bob})
    assert sorted(m["content"] for m in listing["memories"]) == ["Good G.", "Good H."]


async def test_a_row_citing_another_users_row_is_not_changed_by_that_users_forget(
    target: Stack,
) -> None:
    # An import may name any id as a row's evidence; what rests on a row is followed within
    # its user (and aliases) only, so gina's forget and restore reach her rows, not hank's.
    gina, hank = f"user-{uuid.uuid4().hex[:8]}", f"user-{uuid.uuid4().hex[:8]}"
    fact = f"{gina}-fact"

    def memory(user: str, memory_id: str, layer: str, text: str, **fields: Any) -> Any:
        return {"type": "memory", "memory": {"user_id": user, "id": memory_id, "layer": layer,
                                             "content": text, **fields}}

    status, reply = await _import(target, [
        memory(gina, fact, "l3_fact", "Gina keeps bees on the roof."),
        memory(gina, f"{gina}-k", "l5_knowledge", "Gina is a beekeeper.", source_ids=[fact]),
        memory(hank, f"{hank}-k", "l5_knowledge", "Hank knows a beekeeper.", source_ids=[fact]),
    ])
    assert status == 200 and reply["imported"] == 3, reply

    async def how(user: str) -> str | None:
        status, listing = await call(target, "POST", "/api/v1/list", json={
            "user_id": user, "layer": "l5_knowledge", "include_superseded": True})
        assert status == 200 and listing["total"] == 1, listing
        return listing["memories"][0].get("superseded_how")

    status, body = await call(target, "POST", "/api/v1/forget",
                              json={"memory_id": fact, "user_id": gina})
    assert status == 200, body
    assert (await how(gina), await how(hank)) == ("stale", None)
    status, body = await call(target, "POST", "/api/v1/restore",
                              json={"id": fact, "user_id": gina})
    assert status == 200, body
    assert (await how(gina), await how(hank)) == (None, None)


async def test_a_client_hanging_up_during_an_export_or_an_import_is_no_error(
    target: Stack,
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    long = "The lighthouse log, page {n}: " + "calm sea, light wind. " * 3000  # ~66 KB
    lines = [{"type": "memory", "memory": {"user_id": user, "content": long.format(n=n)}}
             for n in range(150)]  # ~10 MB of export, more than the socket buffers hold
    status, reply = await _import(target, lines)
    assert status == 200 and reply["imported"] == 150, reply
    port = target.env["HYATLAS_GO_PORT"]
    head = f"Host: 127.0.0.1:{port}\r\n"
    requests = [
        f"GET /api/v1/export?user_id={user} HTTP/1.1\r\n{head}\r\n".encode(),
        (f"POST /api/v1/import HTTP/1.1\r\n{head}Content-Type: application/x-ndjson\r\n"
         "Content-Length: 1000000\r\n\r\n").encode() + json.dumps(lines[0]).encode()[:5000],
    ]
    for request in requests:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
        writer.write(request)
        await writer.drain()
        if request.startswith(b"GET"):
            await reader.readexactly(1000)  # the export is under way
        writer.transport.abort()  # hangs up at once, unread bytes and all
    log_path = target.data_dir / "gateway.log"

    def both_seen() -> None:
        assert log_path.read_text().count("the client went away") == 2

    await assert_eventually(both_seen)
    assert "error id" not in log_path.read_text()


async def test_lines_without_ids_sent_again_are_skipped_not_written_twice(target: Stack) -> None:
    # Until 2026-12-07 a line without id got a new one each time, so a client resending its
    # file (its reply lost, or the import cut short) wrote every such line again.
    user = f"user-{uuid.uuid4().hex[:8]}"

    def line(text: str, **more: Any) -> dict[str, Any]:
        return {"type": "memory", "memory": {"user_id": user, "content": text, **more}}

    lines = [
        line("Ana paints on Sundays."),
        line("Ana paints on Sundays.", session_id="s2"),  # another session: another memory
        line("Ana paints on Sundays.", layer="l2_raw"),  # the first, its default given: one
        line("Ben rows.", event_at=1_700_000_000),
        line("Ben rows.", event_at=1_700_086_400),  # the next day: another memory
        line("Ben rows.", event_at=1_700_086_400),  # said twice alike: one memory
    ]
    status, reply = await _import(target, lines)
    assert status == 200 and (reply["imported"], reply["skipped"]) == (4, 2), reply
    first = await export(target, user_id=user)
    assert len(first[1:-1]) == 4
    for _ in range(2):  # sent again whole, twice
        status, reply = await _import(target, lines)
        assert status == 200 and (reply["imported"], reply["skipped"]) == (0, 6), reply
        assert (await export(target, user_id=user))[1:] == first[1:]
    # With a line added, the added line alone is written.
    status, reply = await _import(target, [*lines, line("Cy sings.")])
    assert status == 200 and (reply["imported"], reply["skipped"]) == (1, 6), reply
    ids = [row["memory"]["id"] for row in (await export(target, user_id=user))[1:-1]]
    assert ids[:4] == [row["memory"]["id"] for row in first[1:-1]] and len(ids) == 5


async def test_a_line_left_unembedded_as_held_but_deleted_before_its_write_gets_its_own_vector(
    target: Stack,
) -> None:
    # Since 2026-12-08 EmbedImport leaves out the lines whose id the owner holds (the import
    # skips them), so a resent file runs no model. A row deleted between the two calls is
    # written after all: its batch is embedded again, no line given another line's vector.
    user = f"user-{uuid.uuid4().hex[:8]}"
    lines = [
        {"type": "memory", "memory": {"user_id": user, "content": text}}
        for text in ("Ana paints on Sundays.", "Ben rows at dawn.")
    ]
    status, reply = await _import(target, lines[:1])
    assert status == 200 and reply["imported"] == 1, reply
    (held,) = (await export(target, user_id=user))[1:-1]
    request = store_pb2.ImportRowsRequest(
        scope=common_pb2.Scope(all_users=True),
        lines=[store_pb2.ImportLine(line=n, json=json.dumps(x)) for n, x in enumerate(lines, 1)],
        actor="api",
    )
    async with open_channel(target.address("store")) as channel:
        stub = store_pb2_grpc.StoreStub(channel)
        embedded = await stub.EmbedImport(request)
        assert (list(embedded.held_lines), embedded.rows) == ([1], 1)
        status, body = await call(target, "POST", "/api/v1/delete_all",
                                  json={"user_id": user, "id": held["memory"]["id"]})
        assert status == 200, body
        request.vectors, request.vectors_model_id = embedded.vectors, embedded.model_id
        request.held_lines.extend(embedded.held_lines)
        written = await stub.ImportRows(request)
    assert (written.imported, written.skipped, list(written.errors)) == (2, 0, [])
    by_text = {
        line["memory"]["content"]: line["vector"]
        for line in (await export(target, user_id=user))[1:-1]
    }
    assert by_text["Ana paints on Sundays."] == held["vector"]
    assert by_text["Ben rows at dawn."] != held["vector"]


async def test_a_line_without_id_gets_an_id_only_its_store_can_make(
    source: Stack, target: Stack
) -> None:
    # Made in a namespace anyone can read (the source's), an id named the line's text and owner:
    # another owner's import naming it learnt, from "taken by another memory", that the text
    # was held. Each store makes its own secret namespace once and keeps it over restarts.
    user = f"user-{uuid.uuid4().hex[:8]}"
    line = {"type": "memory", "memory": {"user_id": user, "content": "My PIN is 4471."}}

    async def id_in(stack: Stack) -> str:
        status, reply = await _import(stack, [line])
        assert status == 200 and reply["imported"] + reply["skipped"] == 1, reply
        (row,) = (await export(stack, user_id=user))[1:-1]
        return str(row["memory"]["id"])

    on_source, on_target = await id_in(source), await id_in(target)
    assert on_source != on_target
    target.procs["store"].stop()
    target.start("store")
    assert await id_in(target) == on_target  # sent again after a restart: skipped, same id
    async with open_channel(target.address("store")) as channel:
        with raises_code(grpc.StatusCode.INVALID_ARGUMENT) as info:
            await store_pb2_grpc.StoreStub(channel).Apply(store_pb2.ApplyRequest(
                scope=common_pb2.Scope(all_users=True),
                ops=[store_pb2.Op(set_state=store_pb2.SetStateOp(key="line_ids"))]))
    assert "'line_ids' is the store's own state key" in (info.value.details() or "")


async def test_minimal_lines_are_embedded_keyed_and_searchable(target: Stack) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    turns = [
        "Where should we go hiking this weekend?",
        "The Serra da Estrela trails are beautiful in October.",
        "Then let's book the mountain cabin near Manteigas.",
    ]
    lines = [
        {
            "type": "memory",
            "memory": {
                "user_id": user,
                "session_id": "trip",
                "content": text,
                "created_at": 1_700_000_000 + i,
                "id": f"{user}-{i}",
            },
        }
        for i, text in enumerate(turns)
    ]
    lines.append({"type": "memory", "memory": {"user_id": user, "content": LONG_TEXT}})
    status, reply = await _import(target, lines)
    assert status == 200, reply
    assert (reply["imported"], reply["skipped"]) == (4, 0)

    status, body = await call(
        target, "POST", "/api/v1/search", json={"query": "mountain cabin booking", "user_id": user}
    )
    hits = [m for items in body["memories"].values() for m in items]
    assert hits and hits[0]["memory_id"] == f"{user}-2"
    exported = await export(target, user_id=user)
    by_content = {line["memory"]["content"]: line for line in exported[1:-1]}
    middle = by_content[turns[1]]
    assert middle["memory"]["created_at"] == 1_700_000_001
    assert middle["memory"]["layer"] == "l2_raw"
    assert middle["memory"]["extraction_status"] == "skipped"  # lite, as /add would set it
    assert turns[0] in middle["keys"][0]["text"] and turns[2] in middle["keys"][0]["text"]
    # Every key is what an ordinary write of the same turns builds.
    written = f"user-{uuid.uuid4().hex[:8]}"
    for text in turns:
        await call(
            target,
            "POST",
            "/api/v1/add",
            json={"text": text, "user_id": written, "session_id": "trip"},
        )
    await call(target, "POST", "/api/v1/add", json={"text": LONG_TEXT, "user_id": written})
    ordinary = {
        line["memory"]["content"]: line
        for line in (await export(target, user_id=written))[1:-1]
    }
    assert {c: line["keys"] for c, line in by_content.items()} == {
        c: line["keys"] for c, line in ordinary.items()
    }
    # four sentences, keyed as two runs of two
    assert [k["kind"] for k in by_content[LONG_TEXT]["keys"]].count("clause") == 2
    assert [(e["actor"], e["action"], e["reason"]) for e in middle["history"]] == [
        ("api", "insert", "import")
    ]


async def test_vectors_of_another_model_are_embedded_again(target: Stack) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    foreign = base64.b64encode(np.ones(8, dtype="<f4").tobytes()).decode()
    lines = [
        {"format": "hyatlas-export", "version": 1, "model_id": "other-model", "ndim": 8},
        {
            "type": "memory",
            "memory": {"user_id": user, "content": "The cat is called Miso.", "id": f"{user}-c"},
            "vector": foreign,
        },
    ]
    status, reply = await _import(target, lines)
    assert status == 200, reply
    status, body = await call(
        target, "POST", "/api/v1/search", json={"query": "name of the cat", "user_id": user}
    )
    hits = [m for items in body["memories"].values() for m in items]
    assert [m["memory_id"] for m in hits] == [f"{user}-c"]


async def test_exporting_every_owner_needs_admin_and_one_owner_only_sees_its_rows(
    source: Stack, tmp_path: Path, embedder_address: str
) -> None:
    mine, other = f"user-{uuid.uuid4().hex[:8]}", f"user-{uuid.uuid4().hex[:8]}"
    for user in (mine, other):
        await call(source, "POST", "/api/v1/add", json={"text": "hello there", "user_id": user})
    exported = await export(source, user_id=mine)
    assert {line["memory"]["user_id"] for line in exported[1:-1]} == {mine}
    with running_stack(
        tmp_path, ["store", "gateway"], HYATLAS_EMBEDDER_ADDR=embedder_address
    ) as plain:
        status, body = await call(plain, "GET", "/api/v1/export")
        assert status == 403 and "HYATLAS_ADMIN=on" in body["error"]


async def test_an_export_cut_at_a_line_end_is_written_as_far_as_it_goes_and_said_incomplete(
    source: Stack, target: Stack
) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    for n in range(6):
        status, body = await call(
            source, "POST", "/api/v1/add", json={"text": f"Cut note {n}.", "user_id": user}
        )
        assert status == 200, body
    exported = await export(source, user_id=user)
    assert exported[0]["end_line"] is True
    assert exported[-1] == {"type": "end", "lines": len(exported) - 1}
    rows = len(exported) - 2
    assert rows >= 6

    # A copy cut at a line's end (the header and three lines): it imported as a clean 200.
    status, reply = await _import(target, exported[:4])
    assert status == 400, reply
    assert reply == {
        "lines": 3, "imported": 3, "skipped": 0, "refused": 0, "errors": [], "stopped": False,
        "complete": False,
        "error": "the export's end line is missing: the file may be cut short (a partial copy "
        "or an interrupted download), and only its 3 lines were read",
    }
    status, listed = await call(target, "POST", "/api/v1/list", json={"user_id": user})
    assert listed["total"] == 3, listed
    # The whole file then: the lines written are skipped, the rest written.
    status, reply = await _import(target, exported)
    assert status == 200, reply
    assert reply == {
        "lines": rows, "imported": rows - 3, "skipped": 3, "refused": 0, "errors": [],
        "stopped": False, "complete": True,
    }
    # A line gone from the middle: the end line counts the lines before it.
    status, reply = await _import(target, [*exported[:2], *exported[3:]])
    assert status == 400, reply
    assert (reply["complete"], reply["refused"], reply["skipped"]) == (False, 0, rows - 1)
    assert reply["error"] == (
        f"the export's end line counts {rows + 1} lines before it, but {rows} came: lines are "
        "missing from the file"
    )
    # An end line after refused lines: both are said.
    bad = {"type": "memory", "memory": {"content": "Whose?"}}
    status, reply = await _import(target, [*exported[:2], bad, exported[-1]])
    assert status == 400, reply
    assert reply["error"] == (
        f"line 3: memory.user_id is required; the export's end line counts {rows + 1} lines "
        "before it, but 3 came: lines are missing from the file"
    )
    # An end line of the wrong shape is a refused line.
    status, reply = await _import(target, [*exported[:2], {"type": "end", "lines": "2"}])
    assert status == 400, reply
    assert reply["errors"][0]["line"] == 3 and "an end line is" in reply["errors"][0]["error"]

    # An export from before end lines (its header promises none), and minimal lines without a
    # header: imported as they were, with no word on an end.
    older = {key: value for key, value in exported[0].items() if key != "end_line"}
    status, reply = await _import(target, [older, *exported[1:4]])
    assert status == 200 and "complete" not in reply, reply
    minimal = {"type": "memory", "memory": {"user_id": user, "content": "A minimal line."}}
    status, reply = await _import(target, [minimal])
    assert status == 200 and "complete" not in reply, reply


async def test_an_export_cut_short_by_a_failing_store_is_seen_incomplete(target: Stack) -> None:
    user = f"user-{uuid.uuid4().hex[:8]}"
    model = (await export(target))[0]["model_id"]
    vector = base64.b64encode(np.full(384, 384**-0.5, dtype="<f4").tobytes()).decode()
    lines = [
        {
            "type": "memory",
            "memory": {"user_id": user, "content": f"Row {i} " + "padding " * 300},
            "vector": vector,
            "model_id": model,
        }
        for i in range(3000)
    ]
    status, reply = await _import(target, lines)
    assert status == 200 and reply["imported"] == 3000, reply
    async with (
        aiohttp.ClientSession() as session,
        session.get(target.base_url + "/api/v1/export", params={"user_id": user}) as answer,
    ):
        assert answer.status == 200
        # More than the sockets can buffer: the gateway waits on the reader with pages to go.
        await answer.content.readline()
        target.procs["store"].kill()
        with pytest.raises(aiohttp.ClientPayloadError):
            await answer.read()


async def test_an_import_of_several_batches_is_written_whole_with_the_default_embedder_queue(
    tmp_path: Path,
) -> None:
    # The embedder refuses a call while another's texts wait past its queue limit (default 256
    # vectors): a batch (500 lines) asked for while the one before was still embedding was
    # refused, embedded as it was written, and refused there too beside the next one (a 503).
    user = "several-batches"
    lines = [{"type": "memory", "memory": {"user_id": user, "content": f"Note number {n}."}}
             for n in range(1200)]
    with running_stack(
        tmp_path, ["embedder", "store", "search", "gateway"], HYATLAS_EMBED_MAX_QUEUE="256"
    ) as stack:
        status, reply = await _import(stack, lines)
        assert status == 200, reply
        assert (reply["lines"], reply["imported"], reply["refused"]) == (1200, 1200, 0)
        status, listed = await call(stack, "POST", "/api/v1/list",
                                    json={"user_id": user, "limit": 1})
        assert status == 200 and listed["total"] == 1200
        # Every batch was embedded ahead, none as it was written.
        assert "embedding ahead failed" not in (tmp_path / "gateway.log").read_text()


async def test_writes_beside_an_import_are_not_refused_for_its_texts(tmp_path: Path) -> None:
    # An import's batch (500 lines, past the queue's limit) waited in the embedder's one queue,
    # and every write asked for meanwhile was refused as the queue being full (a 503).
    lines = [{"type": "memory", "memory": {"user_id": "importer", "content": f"Note {n}."}}
             for n in range(600)]
    with running_stack(
        tmp_path, ["embedder", "store", "search", "gateway"], HYATLAS_EMBED_MAX_QUEUE="64"
    ) as stack:
        importing = asyncio.create_task(_import(stack, lines))
        statuses = []
        while not importing.done():
            text = f"A write beside the import, number {len(statuses)}."
            status, _ = await call(stack, "POST", "/api/v1/add",
                                   json={"user_id": "writer", "text": text})
            statuses.append(status)
        status, reply = await importing
        assert status == 200, reply
        assert (reply["lines"], reply["imported"]) == (600, 600)
        assert statuses and set(statuses) == {200}
        status, listed = await call(stack, "POST", "/api/v1/list",
                                    json={"user_id": "writer", "limit": 1})
        assert status == 200 and listed["total"] == len(statuses)


async def test_an_import_stopped_part_way_says_what_it_wrote_before(target: Stack) -> None:
    user = "stopped-part-way"
    lines = [{"type": "memory", "memory": {"user_id": user, "content": f"Note number {n}."}}
             for n in range(1000)]
    over = b'{"type": "memory", "memory": {"content": "' + b"x" * (9 << 20) + b'"}}\n'
    body = "".join(json.dumps(x) + "\n" for x in lines).encode() + over
    status, reply = await _import(target, body)
    # The long line stopped the reading; every line read before it is written all the same.
    assert status == 400, reply
    assert "over the 8388608 byte limit" in reply["error"] and reply["stopped"] is True
    assert (reply["lines"], reply["imported"], reply["refused"]) == (1000, 1000, 0)
    status, listed = await call(target, "POST", "/api/v1/list",
                                json={"user_id": user, "limit": 1000})
    assert status == 200 and listed["total"] == 1000



async def _chunked_import_cut(stack: Stack, lines: int, then: bytes) -> bytes:
    """Sends an import of 1,000 lines in one chunk cut after `lines` of them and a half, then
    `then` (b"" hangs up); the whole body, and the server's answer until it closed."""
    user = f"user-{uuid.uuid4().hex[:8]}"
    model = (await export(stack, user_id="nobody"))[0]["model_id"]
    body = [(vector_line(user, n, model) + "\n").encode() for n in range(1_000)]
    sent = b"".join(body[:lines]) + body[lines][:100]
    reader, writer = await asyncio.open_connection("127.0.0.1", int(stack.env["HYATLAS_GO_PORT"]))
    try:
        writer.write(
            b"POST /api/v1/import HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            b"\r\n" + b"%x\r\n" % len(sent) + sent + b"\r\n" + then
        )
        await writer.drain()
        if not then:
            writer.write_eof()
        answer = await asyncio.wait_for(reader.read(), WAIT_CEILING_S)
    finally:
        writer.close()
    return b"".join(body), answer


async def _rows(stack: Stack, body: bytes) -> list[str]:
    user = json.loads(body.partition(b"\n")[0])["memory"]["user_id"]
    return [line["memory"]["id"] for line in (await export(stack, user_id=user))[1:-1]]


async def test_an_import_whose_chunked_framing_breaks_writes_the_whole_lines_before_it(
    target: Stack,
) -> None:
    # A chunk size that is not hex: until 2026-12-07 the import waited for the rest of the
    # body until HYATLAS_BODY_TIMEOUT, then answered 408, "request body not received".
    body, answer = await _chunked_import_cut(target, 700, then=b"zz\r\n")
    head, _, reply = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer
    assert json.loads(reply) == {
        "lines": 700, "imported": 700, "skipped": 0, "refused": 0, "errors": [],
        "stopped": True, "error": "bad body: Invalid character in chunk size",
    }
    assert len(await _rows(target, body)) == 700
    # Sent again, it writes the rest: the lines written are skipped.
    status, again = await _import(target, body)
    assert status == 200 and (again["imported"], again["skipped"]) == (300, 700), again
    rows = await _rows(target, body)
    assert len(rows) == len(set(rows)) == 1_000


async def test_an_import_whose_client_hangs_up_writes_the_whole_lines_sent_and_logs_them(
    target: Stack,
) -> None:
    # Until 2026-12-07 the batches read but not yet written (here all 700 lines) were lost.
    body, answer = await _chunked_import_cut(target, 700, then=b"")
    assert answer == b""  # no answer reaches a client gone

    async def written() -> None:
        assert len(await _rows(target, body)) == 700

    await assert_eventually(written)
    log = (target.data_dir / "gateway.log").read_text()
    assert (
        "POST /api/v1/import: the client went away (Connection lost) after line 700 of its "
        "body; every line read is settled: {'lines': 700, 'imported': 700, 'skipped': 0, "
        "'refused': 0, 'errors': []}"
    ) in log
    status, again = await _import(target, body)
    assert status == 200 and (again["imported"], again["skipped"]) == (300, 700), again
    rows = await _rows(target, body)
    assert len(rows) == len(set(rows)) == 1_000
