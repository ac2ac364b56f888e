"""shared.leases against a real store: held leases are renewed and released, a lost one stops
its block."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.consolidator.config import ConsolidatorConfig
from services.extractor.config import ExtractorConfig
from services.store.config import StoreConfig
from services.store.server import running_server
from shared.leases import LEASE_TTL_MAX_S, LeaseBusy, LeaseLost, LeasePolicy, Leases
from shared.pb import common_pb2
from shared.rpc import open_channel
from shared.store_client import GraphStoreClient, state_op
from tests.support import StoreBackend, assert_eventually

TTL_S = 0.6


@pytest.fixture
async def store(tmp_path: Path, embedder_address: str) -> AsyncIterator[GraphStoreClient]:
    config = StoreConfig(
        data_dir=tmp_path,
        address=f"unix:{tmp_path / 'store.sock'}",
        embedder_address=embedder_address,
        store_dsn=StoreBackend.dsn(tmp_path),
    )
    async with running_server(config) as address, open_channel(address) as channel:
        yield GraphStoreClient(channel)


def replica(store: GraphStoreClient, name: str) -> Leases:
    return Leases(store, LeasePolicy(ttl_s=TTL_S, poll_s=0.05), holder=name)


async def stored(store: GraphStoreClient, name: str) -> tuple[str, float]:
    """The lease's holder and expiry as the store keeps them, or ("", 0)."""
    value = (await store.state("lease/")).get("lease/" + name)
    lease = json.loads(value) if value else {"holder": "", "expires_at": 0}
    return lease["holder"], float(lease["expires_at"])


async def test_a_held_lease_is_renewed_past_its_ttl_and_released_after(
    store: GraphStoreClient,
) -> None:
    first, second = replica(store, "a"), replica(store, "b")
    async with first.held("job", wait=False):
        holder, expires_at = await stored(store, "job")
        assert holder == "a"

        async def renewed_past_the_first_expiry() -> None:
            holder_now, later = await stored(store, "job")
            assert holder_now == "a" and later > expires_at + TTL_S

        await assert_eventually(renewed_past_the_first_expiry)
        with pytest.raises(LeaseBusy, match="held by a"):
            async with second.held("job", wait=False):
                pass
    assert await stored(store, "job") == ("", 0)
    async with second.held("job", wait=False):
        assert (await stored(store, "job"))[0] == "b"


async def test_a_lease_taken_over_stops_its_block_with_lease_lost(
    store: GraphStoreClient,
) -> None:
    first = replica(store, "a")
    with pytest.raises(LeaseLost):
        async with first.held("job", wait=False):
            # Another holder takes the lease over (as after an expiry): the next renewal is
            # refused and the block stops.
            taken = {"holder": "b", "expires_at": 4e9}
            await store.apply(
                common_pb2.Scope(all_users=True), [state_op("lease/job", taken)], "test", "take"
            )
            await asyncio.Event().wait()
    assert (await stored(store, "job"))[0] == "b"  # a release never frees another's lease


@pytest.mark.parametrize("config", [ExtractorConfig, ConsolidatorConfig])
def test_a_lease_ttl_setting_past_what_the_store_grants_takes_the_most(config: Any) -> None:
    # The store refuses a lease over a day: a longer setting would leave every claim refused.
    assert config.from_env({"HYATLAS_LEASE_TTL": "48h"}).lease_ttl_s == LEASE_TTL_MAX_S
    assert config.from_env({"HYATLAS_LEASE_TTL": "90s"}).lease_ttl_s == 90.0
