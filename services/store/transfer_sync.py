"""A sync import: lines compared with the rows and edges they name, changed ones told apart,
and what is gone from the exporting store taken away here too."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from services.store.core import Write
from services.store.erase import erase
from services.store.model import AuditEntry, Edge, MemoryRow
from services.store.repo import UPDATABLE_COLUMNS, row_fields
from services.store.transfer_format import EdgeLine, GoneLine, MemoryLine, history_entry
from services.store.transfer_repo import StoredKey, TransferRows

ROW_COLUMNS = {
    f.name: "metadata" if f.name == "metadata_json" else f.name
    for f in dataclasses.fields(MemoryRow)
    if f.name != "id"
}
"""Each field of a row a sync may compare, with its column."""
EDGE_UPDATABLE = (
    "weight", "source_ids", "fact_ids", "memory_id", "recorded_at", "invalidated_at",
    "valid_from", "valid_to", "stale", "pass_id",
)
"""The fields of an edge that change after it is written (its owner and names never do)."""
GONE_REASON = "import: gone from the exported store"


@dataclass(frozen=True)
class Stored:
    """What the store holds of the ids a sync batch names: rows with their keys and history,
    and edges with whether each was undone."""

    rows: dict[str, MemoryRow]
    keys: dict[str, list[StoredKey]]
    history: dict[str, list[AuditEntry]]
    edges: dict[str, tuple[Edge, bool]]

    @classmethod
    async def read(
        cls, sql: TransferRows, items: Sequence[MemoryLine | EdgeLine | GoneLine]
    ) -> Stored:
        """What the store holds of the memories and edges the lines name."""
        memory_ids, edge_ids = _named(items)
        rows = await sql.rows_of(memory_ids)
        held = list(rows)
        return cls(
            rows, await sql.keys_of(held), await sql.history_of(held),
            await sql.edges_of(edge_ids),
        )

    def resolved(self, item: MemoryLine | EdgeLine | GoneLine) -> Any:
        """A line over what the store holds of its id: the fields it leaves out (a minimal
        line's) are the stored row's or edge's, not the defaults of a new one."""
        if isinstance(item, MemoryLine) and item.given is not None and item.row.id in self.rows:
            fields = {name: getattr(item.row, name) for name in item.given}
            kept = replace(self.rows[item.row.id], model_id=item.row.model_id)
            return replace(item, row=replace(kept, **fields))
        if isinstance(item, EdgeLine) and item.given is not None and item.edge.id in self.edges:
            fields = {name: getattr(item.edge, name) for name in item.given}
            return replace(item, edge=replace(self.edges[item.edge.id][0], **fields))
        return item

    def unreplaceable(self, numbers: Sequence[int], items: Sequence[Any]) -> list[tuple[int, str]]:
        """The lines that name a stored row or edge but differ from it in what never changes
        after a write (a row's layer, session, evidence, creation time or write mode; an
        edge's names): another row or edge under the same id, which a sync does not replace."""
        errors = []
        for number, given in zip(numbers, items, strict=True):
            item = self.resolved(given)
            if isinstance(item, MemoryLine) and item.row.id in self.rows:
                fixed = _fixed_row_fields(self.rows[item.row.id], item.row)
            elif isinstance(item, EdgeLine) and item.edge.id in self.edges:
                fixed = _fixed_edge_fields(self.edges[item.edge.id][0], item.edge)
            else:
                continue
            if fixed:
                what = "memory" if isinstance(item, MemoryLine) else "edge"
                errors.append((number, (
                    f"{what} {_id(item)!r} differs from the stored one in {fixed[0]}, which "
                    f"no change of a {what} alters: it is not the same {what}, and is not "
                    "replaced"
                )))
        return errors

    def row_changed(self, line: MemoryLine) -> bool:
        """Whether the line differs from its stored row: its fields, or (when the line gives
        them) its keys' kinds and texts or its history. Vectors are left out: a row's text
        and model settle them, and each backend stores them at its own precision."""
        return (
            row_fields(self.rows[line.row.id]) != row_fields(line.row)
            or self.keys_differ(line)
            or self.history_differs(line)
        )

    def keys_differ(self, line: MemoryLine) -> bool:
        """Whether the line gives keys other than its stored row's (kinds and texts, in order)."""
        stored = [(key.kind, key.text) for key in self.keys.get(line.row.id, [])]
        return line.keys is not None and stored != [(key.kind, key.text) for key in line.keys]

    def history_differs(self, line: MemoryLine) -> bool:
        """Whether the line gives a history other than its stored row's."""
        stored = [history_entry(e) for e in self.history.get(line.row.id, [])]
        return line.history is not None and stored != [history_entry(e) for e in line.history]

    def edge_changed(self, edge: Edge) -> bool:
        """Whether an edge line differs from its stored edge (an undone one differs from any)."""
        stored, undone = self.edges[edge.id]
        return undone or stored != edge


def _named(items: Sequence[MemoryLine | EdgeLine | GoneLine]) -> tuple[list[str], list[str]]:
    """The memory ids and the edge ids the lines name."""
    memory_ids, edge_ids = [], []
    for item in items:
        if isinstance(item, MemoryLine):
            memory_ids.append(item.row.id)
        elif isinstance(item, EdgeLine):
            edge_ids.append(item.edge.id)
        else:
            (memory_ids if item.kind == "memory" else edge_ids).append(item.id)
    return memory_ids, edge_ids


def _id(item: MemoryLine | EdgeLine) -> str:
    return item.row.id if isinstance(item, MemoryLine) else item.edge.id


def _fixed_row_fields(stored: MemoryRow, row: MemoryRow) -> list[str]:
    return [
        name for name, column in ROW_COLUMNS.items()
        if column not in UPDATABLE_COLUMNS and getattr(stored, name) != getattr(row, name)
    ]


def _fixed_edge_fields(stored: Edge, edge: Edge) -> list[str]:
    return [
        f.name for f in dataclasses.fields(Edge)
        if f.name not in EDGE_UPDATABLE and getattr(stored, f.name) != getattr(edge, f.name)
    ]


def changed_columns(stored: MemoryRow, row: MemoryRow) -> dict[str, Any]:
    """The columns of a stored row a line changes, with their new values."""
    return {
        column: getattr(row, name)
        for name, column in ROW_COLUMNS.items()
        if column in UPDATABLE_COLUMNS and getattr(stored, name) != getattr(row, name)
    }


async def replace_edge(w: Write, stored: Stored, edge: Edge) -> None:
    """Gives a stored edge the line's values (live again, if it was undone)."""
    old, undone = stored.edges[edge.id]
    fields: dict[str, Any] = {
        name: getattr(edge, name)
        for name in EDGE_UPDATABLE
        if getattr(old, name) != getattr(edge, name)
    }
    if "stale" in fields:
        fields["stale"] = int(edge.stale)
    if undone:
        fields["undone"] = 0
    await w.tx.update_edge(edge.id, **fields)


async def take_away(w: Write, stored: Stored, gone: GoneLine) -> bool:
    """Deletes for good the row a gone line names, or undoes its edge, when the line's owner
    holds it here; whether anything was taken away."""
    owner = (gone.user_id, gone.agent_id)
    if gone.kind == "memory":
        row = stored.rows.get(gone.id)
        if row is None or (row.user_id, row.agent_id) != owner or await w.tx.get(row.id) is None:
            return False
        await erase(w, row, GONE_REASON)
        return True
    edge, undone = stored.edges.get(gone.id, (None, True))
    if edge is None or undone or (edge.user_id, edge.agent_id) != owner:
        return False
    await w.tx.update_edge(edge.id, undone=1)
    return True
