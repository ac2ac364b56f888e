"""A property-based fuzz run (schemathesis) over every documented operation: no server error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.openapi import from_dict

from gateway.openapi import document
from tests.support import Stack, running_stack

pytestmark = pytest.mark.slow

TOKEN = "fuzz-token"
# Cases per operation, valid and invalid against the document: bounded so the run fits in the
# suite (each case is one real request through the stack).
EXAMPLES = 50
DOCUMENT = document()
SCHEMA = from_dict(DOCUMENT)
OPERATIONS = [
    SCHEMA[path][method.upper()] for path, item in DOCUMENT["paths"].items() for method in item
]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@schemathesis.serializer("application/x-ndjson")
def _json_lines(ctx: object, value: Any) -> bytes:
    """A generated import body: each item of a list one JSON line (any other value as one)."""
    items = value if isinstance(value, list) else [value]
    text = "\n".join(json.dumps(item, ensure_ascii=False) for item in items)
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate stays, as bad bytes


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    """Every service lite mode runs, admin on, with a token; a few rows to find."""
    data_dir: Path = tmp_path_factory.mktemp("fuzz")
    with running_stack(
        data_dir,
        ["store", "search", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_MODE="lite",
        HYATLAS_ADMIN="on",
        HYATLAS_TOKEN=TOKEN,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def session(stack: Stack) -> Iterator[requests.Session]:
    with requests.Session() as client:
        client.headers["Authorization"] = f"Bearer {TOKEN}"
        for text in ("The cat is called Biscuit.", "We moved to Lisbon in May 2023."):
            reply = client.post(f"{stack.base_url}/api/v1/add", json={"text": text}, timeout=120)
            assert reply.status_code == 200, reply.text
        yield client


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
def test_no_input_gives_a_server_error(
    operation: APIOperation, stack: Stack, session: requests.Session
) -> None:
    # Every operation is fuzzed, admin bulk delete too: wiping the fuzz stack's few rows is
    # harmless, and a wipe must answer without a server error like anything else.
    cases = st.one_of(
        *operation.get_strategies_from_examples(),
        operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
        operation.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )

    @settings(
        max_examples=EXAMPLES,
        deadline=None,  # speed is not under test here; a loaded machine is slow
        derandomize=True,  # the same cases every run, so a failure can be replayed
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def fuzz(case: Case) -> None:
        case.call_and_validate(base_url=stack.base_url, session=session, checks=CHECKS,
                               timeout=120)

    fuzz()
