"""The lines of an export, rendered and checked: pure functions, no processes."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from services.store.keys import MAX_KEY_CHARS
from services.store.model import AuditEntry, Edge, MemoryRow
from services.store.transfer_format import (
    EdgeLine,
    GoneLine,
    LineContext,
    MemoryLine,
    edge_line,
    gone_line,
    memory_line,
    parse_line,
)
from services.store.transfer_repo import StoredKey
from shared.errors import InvalidArgument, ServiceError
from shared.export_format import Header, end, end_count, gone_refused, header, read_header

CTX = LineContext(
    model_id="m",
    ndim=4,
    file_model_id="",
    now=1000.0,
    extraction_status="skipped",
    write_mode="lite",
)
DEEP = '{"a":' * 40 + "1" + "}" * 40
LONG_TEXT = "t" * 100_001
UNIT = np.array([0.5, 0.5, 0.5, 0.5], dtype="<f4")


def _b64(vector: np.ndarray) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode()


def _parse(line: dict[str, Any], ctx: LineContext = CTX) -> MemoryLine | EdgeLine | GoneLine:
    return parse_line(json.dumps(line), ctx)


def test_a_rendered_gone_line_parses_back_to_what_it_names() -> None:
    for kind in ("memory", "edge"):
        assert _parse(gone_line(kind, "x1", "u", "a")) == GoneLine(kind, "x1", "u", "a")
    assert _parse({"type": "gone", "gone": {"kind": "edge", "id": "x", "user_id": "u"}}) == (
        GoneLine("edge", "x", "u", "")
    )


def test_a_rendered_row_parses_back_to_the_same_row_with_its_vector_keys_and_history() -> None:
    row = MemoryRow(
        id="r1",
        user_id="u",
        agent_id="a",
        session_id="s",
        layer="l3_fact",
        content="text",
        label="user_preferences",
        count=2,
        hits=3,
        source_ids=("x", "y"),
        metadata_json='{"k":[1,"é"]}',
        model_id="m",
        created_at=1.5,
        updated_at=2.5,
        event_at=None,
        valid_to=9.0,
        due_at=None,
        status="retired",
        invalid_at=3.0,
        superseded_by="r2",
        superseded_how="replaced",
        drop_reason="why",
        retired_by="api",
        pass_id="p",
        extraction_status="done",
        extraction_tries=1,
        write_mode="pro",
        utc_offset_minutes=-480,  # west of UTC: an offset is no count
    )
    entry = AuditEntry(7, 1.5, "api", "insert", "r1", "", json.dumps({"id": "r1"}), "add")
    keys = [
        StoredKey("clause", "a clause", "m", UNIT.tobytes()),
        StoredKey("context", "c", "", None),
    ]
    line = json.loads(json.dumps(memory_line(row, ("m", UNIT.tobytes()), keys, [entry])))
    parsed = _parse(line)
    assert isinstance(parsed, MemoryLine)
    assert parsed.row == row
    assert parsed.vector is not None and parsed.vector.tobytes() == UNIT.tobytes()
    assert parsed.keys is not None
    assert [(k.kind, k.text, k.vector is not None) for k in parsed.keys] == [
        ("clause", "a clause", True),
        ("context", "c", False),
    ]
    assert parsed.history == (AuditEntry(0, 1.5, "api", "insert", "", "", '{"id": "r1"}', "add"),)


def test_a_minimal_line_gets_what_an_ordinary_write_of_a_raw_turn_sets() -> None:
    parsed = _parse({"type": "memory", "memory": {"user_id": "u", "content": "hi"}})
    assert isinstance(parsed, MemoryLine)
    assert parsed.row == MemoryRow(
        id="",
        user_id="u",
        agent_id="",
        session_id="",
        layer="l2_raw",
        content="hi",
        model_id="m",
        created_at=1000.0,
        updated_at=1000.0,
        extraction_status="skipped",
        write_mode="lite",
    )
    assert parsed.vector is None and parsed.keys is None and parsed.history is None
    fact = _parse(
        {"type": "memory", "memory": {"user_id": "u", "content": "f", "layer": "l3_fact"}}
    )
    assert isinstance(fact, MemoryLine) and fact.row.extraction_status == ""


def test_a_vector_of_another_model_is_left_to_be_embedded_again() -> None:
    line = {"type": "memory", "memory": {"user_id": "u", "content": "hi"}, "vector": "AAAA"}
    other = LineContext(**{**CTX.__dict__, "file_model_id": "other"})
    parsed = _parse(line, other)
    assert isinstance(parsed, MemoryLine) and parsed.vector is None
    # Left unread, but not unchecked: a line's broken vector is refused whatever its model.
    for broken in ("@@", 7):
        with pytest.raises(InvalidArgument, match="vector"):
            _parse({**line, "vector": broken}, other)
    nameless = _parse({**line, "vector": _b64(np.array([3.0, 0, 4.0, 0]))})
    assert isinstance(nameless, MemoryLine) and nameless.vector is None  # whose vector is it?
    own = _parse({**line, "vector": _b64(np.array([3.0, 0, 4.0, 0])), "model_id": "m"})
    assert isinstance(own, MemoryLine) and own.vector is not None
    assert own.vector.tolist() == pytest.approx([0.6, 0, 0.8, 0])  # made unit length


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("{nope", "not JSON"),
        ("[1]", "a line must be a JSON object"),
        ('{"type": "row"}', "type 'row' is not 'memory', 'edge' or 'gone'"),
        ('{"type": "gone", "gone": {"kind": "row", "id": "x", "user_id": "u"}}',
         "gone.kind must be 'memory' or 'edge'"),
        ('{"type": "gone", "gone": {"kind": "memory", "user_id": "u"}}', "gone.id is required"),
        ('{"type": "gone", "gone": {"kind": "edge", "id": "x"}}', "gone.user_id is required"),
        ('{"type": "gone", "gone": {"kind": "edge", "id": "x", "user_id": "u", "at": 1}}',
         "unknown gone field 'at'"),
        ('{"type": "gone", "gone": {"kind": "edge", "id": "x", "user_id": " u"}}',
         "gone.user_id ' u' has whitespace around it"),
        ('{"type": "gone", "gone": {"kind": "memory", "id": 7, "user_id": "u"}}',
         "gone.id must be a string"),
        ('{"type": "gone", "gone": []}', "gone must be a JSON object"),
        ('{"type": "memory", "memory": {"user_id": "u"}}', "memory.content is required"),
        ('{"type": "memory", "memory": {"content": "x"}}', "memory.user_id is required"),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", "colour": 1}}',
            "unknown memory field 'colour'",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", "layer": "l9"}}',
            "memory.layer 'l9' is not one of",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", "created_at": "today"}}',
            "memory.created_at must be a number",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", "id": "$ref"}}',
            "memory.id '$ref' is not a usable id",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x"}, "vector": "AAAA", '
            '"model_id": "m"}',
            "vector holds 0 floats, not 4",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", "hits": NaN}}',
            "not JSON: NaN is not JSON",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x"}, "keys": [{}]}',
            "keys[0] must be an object of kind",
        ),
        (
            '{"type": "edge", "edge": {"user_id": "u", "subject": "a", "relation": "b"}}',
            "edge.object is required",
        ),
        # What PostgreSQL cannot hold: an int32 column, an indexed id, a NUL in a JSON list.
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", "count": 3000000000}}',
            "memory.count must be a count: a whole number from 0 to 2^31 - 1",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", "hits": -3}}',
            "memory.hits must be a count: a whole number from 0 to 2^31 - 1",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", "write_mode": "max"}}',
            "memory: write_mode 'max' is not one of lite, pro, ultra",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", '
            '"extraction_status": "later"}}',
            "memory: extraction_status 'later' is not one of pending, done, failed, skipped, "
            "unconfigured",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", "superseded_by": "'
            + "s" * 6000
            + '"}}',
            "memory.superseded_by has 6,000 characters",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", '
            '"source_ids": ["a\\u0000b"]}}',
            "memory.source_ids may not hold a NUL character",
        ),
        # The API's limits on metadata, on a row's in history, on text of keys and edges.
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", "metadata": '
            + DEEP
            + "}}",
            "memory.metadata is nested over 32 levels deep",
        ),
        (
            json.dumps({"type": "memory", "memory": {
                "user_id": "u", "content": "x", "metadata": {"x": "y" * 200_000}}}),
            "memory.metadata is 200,008 bytes as JSON; the limit is 65,536",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x"}, "history": [{"at": 1, '
            '"actor": "api", "action": "insert", "after": {"metadata": ' + DEEP + "}}]}",
            "history[0].after.metadata is nested over 32 levels deep",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x"}, "history": [{"at": 1, '
            '"actor": "api", "action": "insert", "before": {"label": ' + DEEP + "}}]}",
            "history[0].before is nested over 33 levels deep",
        ),
        (
            json.dumps({"type": "memory", "memory": {"user_id": "u", "content": "x"},
                        "keys": [{"kind": "context", "text": "t" * (MAX_KEY_CHARS + 1)}]}),
            f"keys[0].text has {MAX_KEY_CHARS + 1:,} characters; the limit is {MAX_KEY_CHARS:,}",
        ),
        (
            json.dumps({"type": "edge", "edge": {
                "user_id": "u", "subject": "a", "relation": "b", "object": "c",
                "valid_from": 1_768_435_200.0, "valid_to": 1_748_736_000.0}}),
            "edge cannot end (2025-06-01T00:00:00Z) before it began (2026-01-15T00:00:00Z)",
        ),
        (
            json.dumps({"type": "edge", "edge": {
                "user_id": "u", "subject": "a", "relation": "b", "object": LONG_TEXT}}),
            "edge.object has 100,001 characters; the limit is 100,000",
        ),
        (
            json.dumps({"type": "memory", "memory": {
                "user_id": "u", "content": "x", "utc_offset_minutes": 24 * 60}}),
            "memory.utc_offset_minutes 1440 is not between -1439 and 1439 minutes (under a day)",
        ),
        # A NUL in free text, which PostgreSQL cannot hold (SQLite can: refused on both).
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "a\\u0000b"}}',
            "memory.content may not hold a NUL character",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x"}, '
            '"keys": [{"kind": "clause", "text": "\\u0000"}]}',
            "keys[0].text may not hold a NUL character",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", '
            '"metadata": {"k\\u0000": 1}}}',
            "memory.metadata may not hold a NUL character",
        ),
        # A lone surrogate, which no store can encode, wherever the line holds it.
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "a\\ud800b"}}',
            "line.memory.content is not valid Unicode",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x", '
            '"metadata": {"k": ["\\udfff"]}}}',
            "line.memory.metadata.k[0] is not valid Unicode",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x \\ud800"}, '
            '"vector": "AACAPwAAAAAAAAAAAAAAAA==", "model_id": "m", "keys": []}',
            "line.memory.content is not valid Unicode",
        ),
        (
            '{"type": "memory", "memory": {"user_id": "u", "content": "x"}, "history": [{"at": 1, '
            '"actor": "api", "action": "insert", "after": {"content": "\\ud800"}}]}',
            "line.history[0].after.content is not valid Unicode",
        ),
        (
            '{"type": "edge", "edge": {"user_id": "u", "subject": "a", "relation": "b", '
            '"object": "\\udbff"}}',
            "line.edge.object is not valid Unicode",
        ),
    ],
)
def test_a_bad_line_is_refused_with_its_reason(line: str, error: str) -> None:
    with pytest.raises(ServiceError) as refused:  # InvalidArgument, TooLarge for a size
        parse_line(line, CTX)
    assert refused.value.message.startswith(error)


def test_an_edge_line_round_trips_and_a_minimal_one_gets_defaults() -> None:
    edge = Edge(
        id="e",
        user_id="u",
        agent_id="",
        subject="a",
        relation="b",
        object="c",
        weight=0.5,
        source_ids=("s1", "s2"),
        fact_ids=("f",),
        memory_id="m",
        recorded_at=5.0,
        invalidated_at=None,
        valid_from=1.0,
        valid_to=None,
        stale=True,
        pass_id="p",
    )
    assert _parse(json.loads(json.dumps(edge_line(edge)))) == EdgeLine(edge)
    minimal = _parse(
        {"type": "edge", "edge": {"user_id": "u", "subject": "a", "relation": "b", "object": "c"}}
    )
    assert isinstance(minimal, EdgeLine)
    assert (minimal.edge.weight, minimal.edge.recorded_at, minimal.edge.stale) == (
        1.0,
        1000.0,
        False,
    )


def test_the_header_names_the_model_and_refuses_another_format_or_version() -> None:
    assert read_header(json.dumps(header("m", 4, 1.0))) == Header("m", ends=True)
    # An export written before end lines promises none.
    assert read_header('{"format": "hyatlas-export", "version": 1}') == Header("", ends=False)
    # One with gone lines is version 2: a server that reads version 1 alone refuses it whole.
    assert header("m", 4, 1.0, gone=True)["version"] == 2
    assert read_header(json.dumps(header("m", 4, 1.0, gone=True))) == Header(
        "m", ends=True, gone=True
    )
    assert read_header('{"type": "memory"}') is None
    assert read_header("not json") is None
    with pytest.raises(InvalidArgument, match="format 'x' is not 'hyatlas-export'"):
        read_header('{"format": "x"}')
    with pytest.raises(InvalidArgument, match="export version 3 is not 1 or 2"):
        read_header('{"format": "hyatlas-export", "version": 3}')


@pytest.mark.parametrize(
    ("field", "bad", "error"),
    [
        # Until 2026-12-08 these passed as version 1 (True == 1.0 == 1 in Python), and an
        # end_line other than true as none promised (a cut-short file then passed as whole).
        ("version", "true", "export version true is not 1 or 2"),
        ("version", "1.0", "export version 1.0 is not 1 or 2"),
        ("version", "2.0", "export version 2.0 is not 1 or 2"),
        ("version", '"1"', 'export version "1" is not 1 or 2'),
        ("version", "null", "export version null is not 1 or 2"),
        ("end_line", '"true"', 'the header\'s end_line "true" is not true or false'),
        ("end_line", "1", "the header's end_line 1 is not true or false"),
    ],
)
def test_a_header_field_of_another_json_type_is_refused_naming_it(
    field: str, bad: str, error: str
) -> None:
    good = json.dumps(header("m", 4, 1.0))
    text = good.replace(f'"{field}": {json.dumps(header("m", 4, 1.0)[field])}', f'"{field}": {bad}')
    assert text != good
    with pytest.raises(InvalidArgument) as info:
        read_header(text)
    assert info.value.message == error


def test_a_gone_line_is_refused_under_a_header_of_version_1_alone() -> None:
    gone = json.dumps({"type": "gone", "gone": {"kind": "memory", "id": "m", "user_id": "u"}})
    version_1 = read_header(json.dumps(header("m", 4, 1.0)))
    assert gone_refused(gone, version_1) == (
        "a gone line, but the header says version 1: an export with gone lines is version 2"
    )
    assert gone_refused(gone, read_header(json.dumps(header("m", 4, 1.0, gone=True)))) is None
    assert gone_refused(gone, None) is None  # minimal lines: no header to go against
    memory = '{"type": "memory", "memory": {"user_id": "u", "content": "All gone."}}'
    assert gone_refused(memory, version_1) is None
    assert gone_refused("not json, gone", version_1) is None  # the store says what it is


def test_an_end_line_counts_the_lines_before_it_and_one_of_another_shape_is_refused() -> None:
    assert end_count(json.dumps(end(31))) == 31
    assert end_count('{"type": "memory", "memory": {"content": "the end"}}') is None
    assert end_count("not json, the end") is None
    for bad in ('{"type": "end"}', '{"type": "end", "lines": -1}', '{"type": "end", "lines": 1.5}',
                '{"type": "end", "lines": true}', '{"type": "end", "lines": 1, "more": 2}'):
        with pytest.raises(InvalidArgument, match="an end line is"):
            end_count(bad)
