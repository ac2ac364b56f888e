"""Forget (services/store/forget.py) when a row it found changes before its write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.store import forget
from services.store.model import RAW, Insert, Reach, Retire
from services.store.server import running_store
from shared.tombstones import held_tombstones, tombstones, with_tombstones, without_tombstone
from tests.store_state import store_config

VALUE = "Bo's locker code is 4471"


@pytest.mark.parametrize(("how", "after"), [("merged", "merged"), ("updated", "forgotten")])
async def test_a_match_retired_after_forget_found_it_is_forgotten_only_as_an_old_version(
    tmp_path: Path, embedder_address: str, monkeypatch: pytest.MonkeyPatch, how: str, after: str
) -> None:
    async with running_store(store_config(tmp_path, embedder_address)) as store:
        alice = Reach(("alice",))
        rows = await store.apply(alice, [Insert("alice", "", "", "l3_fact", VALUE)] * 3)
        edited, other, newer = (row.id for row in rows if row is not None)
        real_search = forget.vector_search
        searched: list[int] = []

        async def found_then_edited(*args: Any, **kwargs: Any) -> Any:
            hits = await real_search(*args, **kwargs)
            if not searched:
                # A consolidation pass merges one of them, or the extractor updates it, before
                # the forget writes.
                await store.apply(alice, [Retire(edited, superseded_how=how, superseded_by=newer)])
            searched.append(1)
            return hits

        monkeypatch.setattr(forget, "vector_search", found_then_edited)
        gone = await store.forget(alice, forget.Forget(text=VALUE), actor="api")
        reached = {other, newer} | ({edited} if after == "forgotten" else set())
        assert {row.id for row in gone.memories} == reached
        assert (await store.get(alice, edited)).superseded_how == after
        assert (await store.get(alice, other)).superseded_how == "forgotten"


async def test_a_memory_tool_entry_is_found_though_an_older_turn_is_retired_as_it_reads(
    tmp_path: Path, embedder_address: str
) -> None:
    async with running_store(store_config(tmp_path, embedder_address)) as store:
        alice = Reach(("alice",))
        older = [Insert("alice", "", "", RAW, f"turn {n}") for n in range(1000)]
        turns = await store.apply(alice, older)
        entry = Insert("alice", "", "", RAW, "Keeps the spare key under the blue pot",
                       metadata_json='{"write_origin": "memory_tool", "target": "memory"}')
        [note] = await store.apply(alice, [entry])
        repo = store._core.repo
        real_list = repo.list_rows

        async def first_turn_retired_meanwhile(*args: Any) -> Any:
            found = await real_list(*args)
            if turns[0] is not None and (await store.get(alice, turns[0].id)).status == "active":
                await store.apply(alice, [Retire(turns[0].id, superseded_how="forgotten")])
            return found

        repo.list_rows = first_turn_retired_meanwhile  # type: ignore[method-assign]
        asked = forget.Forget(text="spare key", memory_tool=True, target="memory")
        gone = await store.forget(alice, asked, actor="plugin")
        assert note is not None and [row.id for row in gone.memories] == [note.id]


def test_a_held_tombstone_takes_the_place_of_a_guard_and_a_guard_never_of_a_held_one() -> None:
    guarded = with_tombstones("{}", ["a", "b"], 1.0, guard=True)
    assert (tombstones(guarded), held_tombstones(guarded)) == (["a", "b"], [])
    held = with_tombstones(guarded, ["b", "c"], 2.0)
    assert sorted(tombstones(held)) == ["a", "b", "c"]
    assert sorted(held_tombstones(held)) == ["b", "c"]
    assert held_tombstones(with_tombstones(held, ["b"], 3.0, guard=True)) == held_tombstones(held)
    # A restore takes off the guards of its value elsewhere, never a turn's held tombstone.
    assert without_tombstone(held, "b", guard_only=True) is None
    lifted = without_tombstone(held, "a", guard_only=True)
    assert lifted is not None and sorted(tombstones(lifted)) == ["b", "c"]


async def test_a_new_version_written_between_the_forgets_read_and_write_is_forgotten_too(
    tmp_path: Path, embedder_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running_store(store_config(tmp_path, embedder_address)) as store:
        alice = Reach(("alice",))
        (old,) = await store.apply(alice, [Insert("alice", "", "", RAW, VALUE)])
        assert old is not None
        real_search = forget.vector_search
        edits: list[str] = []

        async def found_then_updated(*args: Any, **kwargs: Any) -> Any:
            hits = await real_search(*args, **kwargs)
            if not edits:  # the user's update (another replica) commits before the forget writes
                edited = Insert("alice", "", "", RAW, f"{VALUE} and more", ref="new")
                replaced = Retire(old.id, superseded_how="replaced", superseded_by="$new")
                new, _ = await store.apply(alice, [edited, replaced])
                assert new is not None
                edits.append(new.id)
            return hits

        monkeypatch.setattr(forget, "vector_search", found_then_updated)
        gone = await store.forget(alice, forget.Forget(memory_id=old.id), actor="api")
        assert {row.id for row in gone.memories} == {old.id, *edits}
        assert (await store.get(alice, edits[0])).superseded_how == "forgotten"


async def test_a_near_row_holding_another_number_word_or_negation_is_not_forgotten_with_it(
    tmp_path: Path, embedder_address: str
) -> None:
    # Each pair's vectors lie 0.95 or nearer (the model's cosines: 0.9705, 0.9929, 0.9572, 0.9645).
    texts = [
        "The meeting with Sam is at 3pm on Tuesday.", "The meeting with Sam is at 4pm on Tuesday.",
        "Alice's phone number is 555-0101.", "Alice's phone number is 555-0199.",
        "I am allergic to peanuts.", "I am not allergic to peanuts.",
        "I like hiking.", "I really like hiking.",
    ]
    async with running_store(store_config(tmp_path, embedder_address)) as store:
        alice = Reach(("alice",))
        rows = await store.apply(alice, [Insert("alice", "", "", RAW, text) for text in texts])
        ids = [row.id for row in rows if row is not None]
        forgotten: set[str] = set()
        for asked in (forget.Forget(memory_id=ids[0]), forget.Forget(text=texts[2]),
                      forget.Forget(text=texts[4]), forget.Forget(text=texts[6])):
            gone = await store.forget(alice, asked, actor="api")
            forgotten |= {row.id for row in gone.memories}
        # The other time, number and the negated statement stay; the same value said with a
        # word more goes with it.
        assert forgotten == {ids[0], ids[2], ids[4], ids[6], ids[7]}
        for kept in (ids[1], ids[3], ids[5]):
            assert (await store.get(alice, kept)).status == "active"
