"""The store's domain types: rows, scopes, changes and query results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from shared.layers import LAYER_NAMES, REPLACED

LAYERS = tuple(LAYER_NAMES.values())
MAX_LIMIT = 1000
"""The most rows one page, search or id list may hold: more is refused, never cut."""
SUPERSEDED_HOW = (
    "replaced",
    "updated",
    "merged",
    "restated",
    "dropped",
    "done",
    "forgotten",
    "stale",
    "undone",
)
# Retiring evidence this way takes what was derived from it down too (merges and restatements
# keep the evidence's content alive in their successor).
KILLS_DERIVED = frozenset({"replaced", "dropped", "done", "forgotten", "stale", "undone"})
SUMMARY = "l4_summary"
"""The layer of summaries (the Now page, episodes): each row lists the rows it sums up."""
KNOWLEDGE = "l5_knowledge"
"""The layer of knowledge rows: each states one graph edge's triple, resting on its facts."""
DERIVED_LAYERS = (SUMMARY, KNOWLEDGE, "l6_schema")
"""Layers derived from other rows: each row lists its evidence in source_ids."""
LEARNT_LAYERS = ("l1_profile", "l3_fact", "l7_intention")
"""Layers of the rows extraction learns from a turn (each cites it in source_ids)."""
ACTIVE = "active"
RETIRED = "retired"
RAW = "l2_raw"
"""The layer of conversation turns: the evidence other rows are learnt from."""
ENTITY = "l8_entity"
"""The layer of entity pages: lines of states, each resting on the turn and facts it came from."""
FORGOTTEN = "forgotten"
"""How a row forgotten on request is retired (its value tombstoned on the turns it came from)."""
ERASED = "erased"
"""How evidence deleted for good is gone (no row is retired this way)."""
TOMBSTONED = "tombstoned"
"""How a turn that holds a forgotten value is gone as evidence (it stays live)."""
LINE_IDS_STATE = "line_ids"
"""The service_state key holding the namespace (a random UUID the store makes once, with its
schema) that the ids of import lines without one are made in: a secret, so an id made from a
line's text and owner cannot be made by another caller to learn, from an import refusing it as
taken, whether some owner holds that text."""
UNDONE = "undone"
"""How a row a consolidation pass wrote is retired when the pass is undone."""
STALE = "stale"
"""How a derived row is retired while its evidence is gone (forgotten, deleted, undone)."""
KILLS_SUMMARIES = frozenset({FORGOTTEN, ERASED, TOMBSTONED, UNDONE})
"""Evidence gone this way takes a summary of it down: its text may hold the value forgotten or
deleted, or the text of a pass undone (a summary of a replaced or done row is only out of date,
and rebuilt)."""
OLD_VERSIONS = frozenset({REPLACED, "updated"})
"""How a row retired by a newer version of it is: its text still shows under that version
(`replaced` in a search), so a forget reaches it as it reaches a live row."""
FEW_PASSING = 2_000
"""A search whose filters pass this many of the reach's rows or fewer looks among those rows
only (every key of them scored, every term matched against them at once) instead of searching
all of the owner's and dropping what the filters refuse: a search of a layer the owner holds no
rows of, behind 100,000 raw turns, took 157-163 ms (vectors) and 31-33 ms (keywords) that way."""


@dataclass(frozen=True)
class Reach:
    """The owners a call may touch: some user ids (None: every user), optionally one agent."""

    user_ids: tuple[str, ...] | None
    agent_id: str = ""
    agent_ids: tuple[str, ...] | None = None
    """The agents the caller's grant reaches (None: any), on top of agent_id."""

    def contains(self, user_id: str, agent_id: str) -> bool:
        """Whether a row owned by (user_id, agent_id) lies inside this reach."""
        if self.user_ids is not None and user_id not in self.user_ids:
            return False
        if self.agent_ids is not None and agent_id not in self.agent_ids:
            return False
        return not self.agent_id or agent_id == self.agent_id

    def sql(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """SQL conditions (on columns user_id and agent_id, after prefix) and parameters."""
        where: list[str] = []
        params: list[str] = []
        for column, values in (("user_id", self.user_ids), ("agent_id", self.agent_ids)):
            if values is not None and not values:
                where.append("1 = 0")  # reaches no one (PostgreSQL refuses an empty IN list)
            elif values is not None:
                where.append(f"{prefix}{column} IN ({','.join('?' * len(values))})")
                params.extend(values)
        if self.agent_id:
            where.append(f"{prefix}agent_id = ?")
            params.append(self.agent_id)
        return where, params


@dataclass(frozen=True)
class MemoryRow:
    """One stored memory with every column of the memories table."""

    id: str
    user_id: str
    agent_id: str
    session_id: str
    layer: str
    content: str
    label: str = ""
    count: int = 0
    hits: int = 0
    source_ids: tuple[str, ...] = ()
    metadata_json: str = "{}"
    model_id: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    event_at: float | None = None
    valid_to: float | None = None
    due_at: float | None = None
    status: str = ACTIVE
    invalid_at: float | None = None
    superseded_by: str = ""
    superseded_how: str = ""
    drop_reason: str = ""
    retired_by: str = ""
    pass_id: str = ""
    extraction_status: str = ""
    extraction_tries: int = 0
    write_mode: str = ""
    utc_offset_minutes: int = 0
    """The writer's UTC offset when it was said: its local day (0: UTC, or none given)."""

    @classmethod
    def of_values(cls, values: Sequence[Any]) -> MemoryRow:
        """A row from every field's value in the order above, set straight into its dict: the
        frozen class's own __init__ sets each field through object.__setattr__, 13 us a row
        against 2 so (a hybrid search reads about 170 rows)."""
        row = object.__new__(cls)
        row.__dict__.update(zip(_MEMORY_FIELDS, values, strict=True))
        return row


_MEMORY_FIELDS = tuple(f.name for f in fields(MemoryRow))


@dataclass(frozen=True)
class Insert:
    """A new row; `ref` names it for later ops of the same Apply ("$ref")."""

    user_id: str
    agent_id: str
    session_id: str
    layer: str
    content: str
    label: str = ""
    source_ids: tuple[str, ...] = ()
    metadata_json: str = ""
    event_at: float | None = None
    valid_to: float | None = None
    due_at: float | None = None
    count: int = 0
    extraction_status: str = ""
    write_mode: str = ""
    utc_offset_minutes: int = 0
    pass_id: str = ""
    ref: str = ""
    id: str = ""
    restates_at: float = 0.0
    """Above 0: retire the owner's nearest live fact at this cosine or more as restated."""
    vector: tuple[float, ...] = ()
    """The content's vector if the caller made it (vector_model_id says with which model)."""
    vector_model_id: str = ""


@dataclass(frozen=True)
class Retire:
    """Retires a row, optionally naming its successor by id or "$ref"."""

    id: str
    superseded_how: str = ""
    superseded_by: str = ""
    drop_reason: str = ""
    pass_id: str = ""
    forgets: bool = False
    """A forget's retire: skipped (None) when the row is gone or no longer forgettable by now,
    rather than refused (the forget read its candidates before the write); an old version is
    marked forgotten where it stands."""


def forgettable(row: MemoryRow | None) -> bool:
    """Whether a forget reaches the row: live, or an old version of a newer one (not a row
    forgotten, merged or dropped already, nor one erased)."""
    return row is not None and (row.status == ACTIVE or row.superseded_how in OLD_VERSIONS)


@dataclass(frozen=True)
class Restore:
    """Brings a retired row back to active."""

    id: str


@dataclass(frozen=True)
class Update:
    """Changes the fields that are not None; a new content is re-embedded."""

    id: str
    content: str | None = None
    extraction_status: str | None = None
    extraction_tries: int | None = None
    count: int | None = None
    hits: int | None = None
    metadata_json: str | None = None
    event_at: float | None = None
    valid_to: float | None = None
    due_at: float | None = None
    label: str | None = None
    hits_delta: int = 0
    """Added to the row's hits in the same transaction (instead of setting hits)."""
    if_content: str | None = None
    """Applied only while the row is live and still holds this text; else skipped (None)."""
    require: Unchanged | None = None
    """Applied only while the row is still as the caller read it; else the whole Apply is
    refused (Conflict), for a write that is void once its evidence changed (an extraction)."""


@dataclass(frozen=True)
class Unchanged:
    """A row as a caller read it: live, with this text and these forget tombstones."""

    content: str
    tombstones: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Tombstone:
    """Adds forget tombstones for values to a raw turn's metadata as it reads inside the write.

    The store's own op (forget's): no Apply request carries one.
    """

    id: str
    values: tuple[str, ...]
    guard: bool = False
    """A guard (shared.tombstones): the turn is still to be extracted and not known to hold
    the values, so nothing resting on it goes stale."""


@dataclass(frozen=True)
class Delete:
    """Erases a row, its vector and its keyword entry."""

    id: str


@dataclass(frozen=True)
class PutEdge:
    """Adds an L5 edge, or evidence to the live edge with the same owner and triple."""

    user_id: str
    agent_id: str
    subject: str
    relation: str
    object: str
    source_ids: tuple[str, ...] = ()
    fact_ids: tuple[str, ...] = ()
    memory_id: str = ""
    valid_from: float | None = None
    valid_to: float | None = None
    pass_id: str = ""
    weight: float = 1.0


@dataclass(frozen=True)
class EndEdge:
    """Ends an edge: valid until valid_to, invalidated now."""

    id: str
    valid_to: float | None = None
    pass_id: str = ""


@dataclass(frozen=True)
class SetState:
    """Sets one value of the state table; an empty value removes it."""

    key: str
    value_json: str
    if_value: str | None = None
    """Set: the op changes the value only while the key holds exactly this one."""
    owner: tuple[str, str] | None = None
    """The owner (user_id, agent_id) the key belongs to, for a key of one owner."""

    @property
    def server_wide(self) -> bool:
        """Whether the key is the server's own, not one owner's."""
        return self.owner is None


Op = Insert | Retire | Restore | Update | Tombstone | Delete | PutEdge | EndEdge | SetState


@dataclass(frozen=True)
class Edge:
    """One stored L5 relation."""

    id: str
    user_id: str
    agent_id: str
    subject: str
    relation: str
    object: str
    weight: float
    source_ids: tuple[str, ...]
    fact_ids: tuple[str, ...]
    memory_id: str
    recorded_at: float
    invalidated_at: float | None
    valid_from: float | None
    valid_to: float | None
    stale: bool
    pass_id: str


@dataclass(frozen=True)
class Undone:
    """What undoing a pass changed."""

    restored_ids: list[str] = field(default_factory=list)
    undone_ids: list[str] = field(default_factory=list)
    edge_ids: list[str] = field(default_factory=list)
    kept_ids: list[str] = field(default_factory=list)
    """Rows the pass retired left retired, as what replaced them, their value or their
    evidence is gone since, or their value is live in another row."""
    kept_why: dict[str, str] = field(default_factory=dict)
    """Why each kept row stays retired."""


@dataclass(frozen=True)
class ListQuery:
    """Filters and paging of ListMemories."""

    layers: tuple[str, ...] = ()
    exclude_layers: tuple[str, ...] = ()
    include_superseded: bool = False
    session_id: str = ""
    extraction_status: str = ""
    created_after: float | None = None
    created_before: float | None = None
    newest_first: bool = True
    superseded_by: str = ""
    label: str = ""
    source_id: str = ""
    """Only rows learnt from this row (it is among their source_ids)."""
    contains: str = ""
    """Only rows whose content holds this text, ignoring case (each one's lower case)."""
    tries_below: int = 0
    """Only rows with fewer extraction tries than this (0: no filter)."""
    write_modes: tuple[str, ...] = ()
    """Only rows written in one of these modes (none: any)."""
    limit: int = 20
    """EVERY_ROW for no limit (the store's own reads: one statement, so one snapshot)."""
    offset: int = 0
    past: tuple[float, int] | None = None
    """Only rows past this place (a row's created_at and seq) in the list's order."""

    def write_modes_sql(self) -> tuple[list[str], list[Any]]:
        """The SQL condition (on memories m) and parameters that keep only rows written in one
        of write_modes (none without them)."""
        if not self.write_modes:
            return [], []
        marks = ", ".join("?" * len(self.write_modes))
        return [f"m.write_mode IN ({marks})"], list(self.write_modes)

    def replaced_sql(self) -> tuple[list[str], list[Any]]:
        """The SQL condition (on memories m) and parameters that keep only the rows
        `superseded_by` replaced: a version forgotten since is not shown as replaced (as in a
        search's `replaced`), only where retired rows are listed."""
        if not self.superseded_by:
            return [], []
        return ["m.superseded_by = ?", "m.superseded_how != ?"], [self.superseded_by, FORGOTTEN]

    def past_sql(self) -> tuple[list[str], list[Any]]:
        """The SQL condition (on memories m) and parameters that keep rows past `past`."""
        if self.past is None:
            return [], []
        beyond = "<" if self.newest_first else ">"
        return [f"(m.created_at, m.seq) {beyond} (?, ?)"], list(self.past)


@dataclass(frozen=True)
class ListPage:
    """A page of a list: its rows, how many rows match in all, and the last row's place."""

    rows: list[MemoryRow]
    total: int
    last: tuple[float, int] | None = None


EVERY_ROW = -1


@dataclass(frozen=True)
class CountQuery:
    """Which rows CountMemories counts, in buckets of creation time."""

    layers: tuple[str, ...] = ()
    exclude_layers: tuple[str, ...] = ()
    include_superseded: bool = False
    start: float = 0.0
    bucket_s: float = 86400.0
    buckets: int = 1


@dataclass(frozen=True)
class Scored:
    """A row and the score a search gave it."""

    memory: MemoryRow
    score: float
    matched_terms: int = 0
    replaced: tuple[MemoryRow, ...] = ()
    """Older versions this row replaced, newest first."""
    follows_id: str = ""
    """For a conversation turn: the turn before it in its sitting."""
    passage: str = ""
    """For a vector hit found by one of its sentence keys: that key's text (read for a search
    that leaves out repeats)."""


@dataclass(frozen=True)
class KeywordResult:
    """Keyword hits plus the terms the query was reduced to."""

    hits: list[Scored]
    terms: list[str]
    required_terms: int
    context_hits: list[Scored] = field(default_factory=list)
    """Rows ranked by their context keys (each turn with its neighbours)."""


@dataclass(frozen=True)
class AuditEntry:
    """One mutation of one row."""

    seq: int
    at: float
    actor: str
    action: str
    memory_id: str
    before_json: str
    after_json: str
    reason: str


@dataclass(frozen=True)
class Stats:
    """Row counts and the store's vector model."""

    layers: dict[str, int] = field(default_factory=dict)
    total: int = 0
    unextracted: int = 0
    retired: int = 0
    db_bytes: int = 0
    vectors: int = 0
    model_id: str = ""
    ndim: int = 0
    data_dir: str = ""
    graph_nodes: int = 0
    graph_edges: int = 0
