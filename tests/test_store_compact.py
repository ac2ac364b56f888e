"""Admin compact_raw's rule for one turn (services/store/compact.py)."""

from __future__ import annotations

from services.store.compact import compact_turn


def test_compacting_a_turn_keeps_user_and_assistant_capped() -> None:
    turn = "USER: hi\n\nTOOL: " + "x" * 10 + "\n\nASSISTANT: " + "y" * 5000
    compacted = compact_turn(turn)
    assert "TOOL" not in compacted and compacted.startswith("USER: hi")
    assert len(compacted.encode()) < 4100


def test_a_turn_without_roles_is_only_capped() -> None:
    assert compact_turn("plain text") == "plain text"
    assert len(compact_turn("z" * 20000).encode()) <= 12000
