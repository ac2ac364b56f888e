"""Entity page lines go stale with the facts that fed them and come back with them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.pb import common_pb2, store_pb2, store_pb2_grpc
from shared.rpc import open_channel
from tests.extractor_support import STACK, Api, by_content, new_user
from tests.llm_fake import FakeLlm, fake_llm_in_thread
from tests.support import running_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fake(store_backend: str) -> Iterator[FakeLlm]:
    with fake_llm_in_thread() as fake:
        fake.default = {}
        yield fake


async def change(api: Api, user: str, op: store_pb2.Op) -> None:
    async with open_channel(api.store_address) as channel:
        await store_pb2_grpc.StoreStub(channel).Apply(
            store_pb2.ApplyRequest(scope=common_pb2.Scope(user_id=user), ops=[op]), timeout=30
        )


async def test_retiring_a_fact_hides_the_page_lines_it_fed_and_restoring_it_shows_them(
    tmp_path: Path, embedder_address: str, fake: FakeLlm
) -> None:
    env = {
        "HYATLAS_EMBEDDER_ADDR": embedder_address,
        "HYATLAS_MODE": "pro",
        "HYATLAS_LLM_BASE": fake.url,
        "HYATLAS_LLM_MODEL": "scripted",
        "HYATLAS_LLM_KEY": "key",
        "HYATLAS_EXTRACT_TIMEOUT": "20s",
        "HYATLAS_CATCHUP_EVERY": "off",
    }
    with running_stack(tmp_path, STACK, **env) as stack:
        api = Api(stack.base_url, stack.address("store"))
        user = new_user()
        fake.on(
            "m-old",
            {
                "facts": [{"text": "Foxtrot runs on Postgres 15"}, {"text": "Bob likes tea"}],
                "entities": [{"name": "Foxtrot", "kind": "project", "state": "on Postgres 15"}],
            },
        )
        assert (await api.add("m-old Foxtrot is on Postgres 15; tea.", user))[
            "extraction_status"
        ] == "done"
        fake.on(
            "m-new",
            lambda r: {
                "facts": [{"text": "Foxtrot moved to Postgres 16"}],
                "entities": [
                    {"name": "Foxtrot", "state": "on Postgres 16", "page": r.number_of("Foxtrot:")}
                ],
            },
        )
        assert (await api.add("m-new Foxtrot moved to Postgres 16.", user))[
            "extraction_status"
        ] == "done"
        facts = await api.rows(user, "l3_fact")
        old = by_content(facts, "Foxtrot runs on Postgres 15")
        new = by_content(facts, "Foxtrot moved to Postgres 16")
        tea = by_content(facts, "Bob likes tea")
        (page,) = await api.rows(user, "l8_entity")
        meta = json.loads(page.metadata_json)
        # Each line cites the facts of its turn that name the entity.
        assert meta["facts"] == [new.id]
        assert [h["facts"] for h in meta["history"]] == [[old.id]]
        full = page.content
        assert full.startswith("Foxtrot: on Postgres 16\nHistory:\n- ")
        assert full.endswith(": on Postgres 15")

        # A fact of the same turn that does not name the entity feeds no line.
        await change(
            api, user, store_pb2.Op(retire=store_pb2.RetireOp(id=tea.id, superseded_how="dropped"))
        )
        assert (await api.row(user, page.id)).content == full

        await change(
            api, user, store_pb2.Op(retire=store_pb2.RetireOp(id=new.id, superseded_how="dropped"))
        )
        stale = await api.row(user, page.id)
        assert stale.content.startswith("Foxtrot\nHistory:\n- ")
        assert "Postgres 16" not in stale.content and stale.status == "active"
        assert json.loads(stale.metadata_json)["stale"] is True
        hits = await api.search("Foxtrot Postgres 16", user)
        assert all("on Postgres 16" not in h.get("content", "") for h in hits)

        await change(
            api, user, store_pb2.Op(retire=store_pb2.RetireOp(id=old.id, superseded_how="dropped"))
        )
        assert (await api.row(user, page.id)).content == "Foxtrot"

        await change(api, user, store_pb2.Op(restore=store_pb2.RestoreOp(id=new.id)))
        assert (await api.row(user, page.id)).content == "Foxtrot: on Postgres 16"
        await change(api, user, store_pb2.Op(restore=store_pb2.RestoreOp(id=old.id)))
        back = await api.row(user, page.id)
        assert back.content == full
        assert "stale" not in json.loads(back.metadata_json)
