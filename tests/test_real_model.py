"""A real model (SmolLM2-135M, llama-cpp-python) writes and consolidates: the pipeline survives."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from services.search.stages import DAY_S
from shared.text import content_key
from tests.extractor_support import STACK, Api, new_user
from tests.real_model_support import LlamaServer, ensure_llm_venv, running_llama_server
from tests.support import Stack, running_stack

# The first run on a fresh machine builds llama-cpp-python (minutes); later runs reuse its wheel.
# The limit only stops a hang: alone the test takes about 3 minutes, and more than 15 when
# other work shares the machine's two cores with the model.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# The dates lie ahead of whenever the test runs, so the goals they set are still open.
NEXT_YEAR = datetime.now(UTC).year + 1
CONVERSATION = [
    "Hi! I'm Dana Whitfield and I work as a nurse at St. Mary's Hospital in Leeds.",
    "Big news: last month I moved from Leeds to Bristol, into a flat near the harbour.",
    "I started a new job at Bristol Royal Infirmary as a senior nurse in the children's ward.",
    "By the way, I really prefer tea to coffee, and I can't stand loud restaurants.",
    f"I plan to run the Bristol half marathon on 14 September {NEXT_YEAR}, so I'm training "
    "three times a week.",
    f"Can you remind me to book a physio appointment before the end of August {NEXT_YEAR}?",
]
# Where the extractor puts what it derives from a turn (the raw turn itself stays in l2_raw).
DERIVED_LAYERS = ("l1_profile", "l3_fact", "l5_knowledge", "l7_intention", "l8_entity")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """The real model served on loopback; a venv that cannot be built fails the test."""
    try:
        ensure_llm_venv()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    with running_llama_server(tmp_path_factory.mktemp("llama") / "llama.log") as server:
        yield server


# Every service of ultra mode: extraction on each write (as in pro) plus the consolidation pass.
ULTRA_STACK = [*STACK[:-1], "consolidator", STACK[-1]]
# What a consolidation report carries (the reference's digest fields).
REPORT_FIELDS = {"facts_in", "owners_run", "owners_unchanged", "merged", "edges", "dropped",
                 "schemas", "arc", "pruned_raw", "protected_raw", "duration_ms"}


@pytest.fixture(scope="module")
def ultra(
    tmp_path_factory: pytest.TempPathFactory, embedder_address: str, llama: LlamaServer
) -> Iterator[Stack]:
    """Ultra mode with synchronous extraction by the real model (the writes are pro's)."""
    data_dir: Path = tmp_path_factory.mktemp("real-model")
    with running_stack(
        data_dir,
        ULTRA_STACK,
        HYATLAS_EMBEDDER_ADDR=embedder_address,
        HYATLAS_MODE="ultra",
        HYATLAS_SYNC_EXTRACT="on",
        HYATLAS_LLM_BASE=llama.base_url,
        HYATLAS_LLM_MODEL=llama.model,
        HYATLAS_LLM_KEY="local",
        HYATLAS_EXTRACT_TIMEOUT="120s",
    ) as stack:
        yield stack


def _past_due(memory: dict[str, Any]) -> bool:
    """Whether an intention's due date is more than a day gone (search no longer shows it)."""
    return "due_at" in memory and memory["due_at"] + DAY_S < time.time()


async def test_a_real_model_conversation_ends_extracted_searchable_and_digested(
    ultra: Stack,
) -> None:
    api = Api(ultra.base_url, ultra.address("store"))
    user = new_user()

    written = {}
    for turn in CONVERSATION:
        added = await api.add(turn, user)
        # A synchronous write waits for its extraction: done or failed, never left pending.
        assert added["extraction_status"] in ("done", "failed"), added
        written[added["memory_id"]] = added["extraction_status"]
    # The model's facts are poor, but it answers in JSON, so some extractions must succeed.
    assert "done" in written.values(), written

    raw = await api.ok("GET", "/api/v1/list", params={"user_id": user, "layer": "l2_raw"})
    assert raw["total"] == len(CONVERSATION)
    assert {m["memory_id"] for m in raw["memories"]} == set(written)
    # Catch-up may have extracted a failed row since; none is left pending.
    assert {m["extraction_status"] for m in raw["memories"]} <= {"done", "failed"}, raw
    assert {m["content"] for m in raw["memories"]} == set(CONVERSATION)

    # Whatever it derived, each live row is found by a search for its own text (of rows with
    # the same text but for case and spacing, such as a lesson the model repeats, search shows
    # one), but for an intention past its due date (the model may misread a date): search leaves
    # that out.
    for layer in DERIVED_LAYERS:
        listed = await api.ok("GET", "/api/v1/list", params={"user_id": user, "layer": layer})
        for memory in listed["memories"]:
            hits = await api.search(memory["content"], user, layer=layer, limit=50)
            shown = any(
                hit["memory_id"] == memory["memory_id"]
                or content_key(hit["content"]) == content_key(memory["content"])
                for hit in hits
            )
            assert shown is not _past_due(memory), (memory, hits)

    status = await api.status()
    assert status["llm"] == "ok", status

    # One consolidation pass by the same model ends with a report, and leaves the store
    # unchanged or validly changed: every row is still there, the raw turns untouched, and
    # whatever the pass retired is retired with a known reason and restorable.
    before = await api.ok("GET", "/api/v1/list", params={
        "user_id": user, "limit": 1000, "include_superseded": "true"})
    digest = await api.ok("POST", "/api/v1/digest", json={"user_id": user})
    assert digest["digest_ok"] is True, digest
    assert set(digest["report"]) >= REPORT_FIELDS, digest
    after = await api.ok("GET", "/api/v1/list", params={
        "user_id": user, "limit": 1000, "include_superseded": "true"})
    assert {m["memory_id"] for m in before["memories"]} <= {
        m["memory_id"] for m in after["memories"]}
    raw_after = await api.ok("GET", "/api/v1/list", params={"user_id": user, "layer": "l2_raw"})
    assert {m["content"] for m in raw_after["memories"]} == set(CONVERSATION)
    for memory in after["memories"]:
        if memory.get("invalid_at"):
            assert memory["superseded_how"] in {
                "replaced", "updated", "merged", "restated", "dropped", "done", "forgotten",
                "stale"}, memory
    assert (await api.status())["consolidations"] == 1
