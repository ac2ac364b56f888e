"""Admin compact_raw (services/store/compact.py): its rule for one turn, and turns changed while
it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from services.store.compact import compact_turn
from services.store.model import RAW, Delete, Insert, ListQuery, Reach, Retire
from services.store.server import running_store
from shared.passages import Passage
from tests.store_state import store_config
from tests.support import WAIT_CEILING_S


def test_compacting_a_turn_keeps_user_and_assistant_capped() -> None:
    turn = "USER: hi\n\nTOOL: " + "x" * 10 + "\n\nASSISTANT: " + "y" * 5000
    compacted = compact_turn(turn)
    assert "TOOL" not in compacted and compacted.startswith("USER: hi")
    assert len(compacted.encode()) < 4100


def test_a_users_own_capitalised_line_is_kept_and_caps_count_characters() -> None:
    turn = "USER: groceries\nTODO: buy milk\nNOTE: and eggs\n\nTOOL: ls\n\nASSISTANT: noted"
    kept = "USER: groceries\nTODO: buy milk\nNOTE: and eggs\n\nASSISTANT: noted"
    assert compact_turn(turn) == kept
    # A message the plugin capped at 4,000 characters is not cut again for its bytes.
    accented = "USER: " + "é" * 4000
    assert compact_turn(accented) == accented


def test_a_turn_without_roles_is_only_capped() -> None:
    assert compact_turn("plain text") == "plain text"
    assert len(compact_turn("z" * 20000)) == 12000


async def test_a_turn_changed_while_compaction_embeds_is_left_as_it_is_now(
    tmp_path: Path, embedder_address: str
) -> None:
    async with running_store(store_config(tmp_path, embedder_address)) as store:
        core, alice = store._core, Reach(("alice",))
        turns = [f"USER: turn {n}\n\nTOOL: {'x' * 50}\n\nASSISTANT: fine" for n in range(3)]
        rows = await store.apply(alice, [Insert("alice", "", "", RAW, t) for t in turns])
        kept, retired, deleted = (row.id for row in rows if row is not None)
        embedding, release = asyncio.Event(), asyncio.Event()
        real_embed = core.embed

        async def held_embed(passages: Sequence[Passage]) -> np.ndarray:
            if not embedding.is_set():  # compaction's: held while the turns change
                embedding.set()
                await release.wait()
            return await real_embed(passages)

        core.embed = held_embed  # type: ignore[method-assign]
        compacting = asyncio.create_task(store.compact_raw(dry_run=False, actor="admin"))
        await asyncio.wait_for(embedding.wait(), WAIT_CEILING_S)
        await store.apply(alice, [Retire(retired, superseded_how="forgotten"), Delete(deleted)])
        release.set()
        result = await compacting
        assert (result.rows_changed, result.rows_rewritten) == (3, 1)
        assert "TOOL" not in (await store.get(alice, kept)).content
        assert (await store.get(alice, retired)).content == turns[1]
        every_turn = ListQuery(layers=(RAW,), include_superseded=True)
        assert deleted not in {row.id for row in (await store.list_rows(alice, every_turn)).rows}
