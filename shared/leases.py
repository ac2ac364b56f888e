"""Turns among replicas: named leases the store keeps, held while a block runs, renewed
meanwhile, released after; a replica killed while holding one frees it when its ttl ends."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from shared.errors import Conflict, ServiceError, Unavailable
from shared.grants import CURRENT_GRANT
from shared.pb import store_pb2
from shared.settings import read_duration_always_on

log = logging.getLogger(__name__)


class LeaseBusy(Conflict):
    """Another replica holds the lease."""


class LeaseLost(Unavailable):
    """The lease could not be renewed in time, so the block it covered was stopped."""


LEASE_NAME_MAX = 300
"""The longest lease name the store takes."""

LEASE_TTL_MAX_S = 86_400.0
"""The longest ttl_s the store grants a lease for: a holder that dies is waited out that long
before another replica takes its work over (HYATLAS_LEASE_TTL is 60 s by default)."""


def lease_ttl_setting(environ: Mapping[str, str]) -> float:
    """HYATLAS_LEASE_TTL (60 s by default): one past LEASE_TTL_MAX_S logs a line and takes the
    most, since the store would refuse every claim for it."""
    ttl_s = read_duration_always_on(environ, "HYATLAS_LEASE_TTL", 60.0)
    if ttl_s > LEASE_TTL_MAX_S:
        log.warning("HYATLAS_LEASE_TTL=%r is over a day; using a day", environ["HYATLAS_LEASE_TTL"])
        return LEASE_TTL_MAX_S
    return ttl_s


def lease_name(kind: str, *parts: str) -> str:
    """A lease's name from its kind and the ids it covers (ids may hold any character): the ids
    as JSON, or the SHA-256 of that when it would be longer than LEASE_NAME_MAX."""
    ids = json.dumps(parts, ensure_ascii=False, separators=(",", ":"))
    name = f"{kind}/{ids}"
    if len(name) <= LEASE_NAME_MAX:
        return name
    return f"{kind}/sha256:{hashlib.sha256(ids.encode()).hexdigest()}"


def replica_id() -> str:
    """A holder name for this process: host, pid and a random part (two in one process differ)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class LeaseStore(Protocol):
    """The store call leases need."""

    async def claim_lease(
        self, name: str, holder: str, ttl_s: float
    ) -> store_pb2.ClaimLeaseResponse: ...


@dataclass(frozen=True)
class LeasePolicy:
    """How long a lease lasts unrenewed, and how often a waiting claim asks again."""

    ttl_s: float = 60.0
    poll_s: float = 0.5


class Leases:
    """One replica's leases: each held by one block at a time (callers serialise their own
    blocks of one name; the store only tells replicas apart)."""

    def __init__(self, store: LeaseStore, policy: LeasePolicy, holder: str = "") -> None:
        self.store = store
        self.policy = policy
        self.holder = holder or replica_id()

    @contextlib.asynccontextmanager
    async def held(self, name: str, *, wait: bool) -> AsyncIterator[None]:
        """Runs the block holding the lease: waits for it (wait) or raises LeaseBusy; renews it
        every ttl_s/3; stops the block with LeaseLost when it cannot be renewed before it
        expires; releases it after."""
        claimed_at = await self._acquire(name, wait)
        task = asyncio.current_task()
        assert task is not None
        keeper = asyncio.create_task(self._keep(name, task, claimed_at), name=f"lease {name}")
        try:
            yield
        except asyncio.CancelledError:
            if keeper.done() and keeper.result() and task.uncancel() == 0:
                raise LeaseLost(f"lease {name!r} lost while held") from None
            raise
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            await self._release(name)

    async def _acquire(self, name: str, wait: bool) -> float:
        """Claims the lease (waiting for it, or LeaseBusy); when the granted claim was sent."""
        loop = asyncio.get_running_loop()
        while True:
            sent = loop.time()
            reply = await self._claim(name, self.policy.ttl_s)
            if reply.granted:
                return sent
            if not wait:
                raise LeaseBusy(f"lease {name!r} is held by {reply.holder}")
            await asyncio.sleep(self.policy.poll_s)

    async def _keep(self, name: str, task: asyncio.Task[object], claimed_at: float) -> bool:
        """Renews the lease every ttl_s/3 until cancelled. Once it is lost (refused, or not
        renewed before it would expire), cancels task and returns True."""
        loop = asyncio.get_running_loop()
        period = self.policy.ttl_s / 3
        # The store's expiry is at least ttl_s after the granted claim was sent.
        expires = claimed_at + self.policy.ttl_s
        while True:
            await asyncio.sleep(period)
            sent = loop.time()
            try:
                async with asyncio.timeout_at(expires):
                    reply = await self._claim(name, self.policy.ttl_s)
            except (ServiceError, TimeoutError) as exc:
                why = exc.message if isinstance(exc, ServiceError) else "no answer in time"
                log.warning("lease %s not renewed: %s", name, why)
                if loop.time() + period < expires:
                    continue
                holder = "nobody yet"
            else:
                if reply.granted:
                    expires = sent + self.policy.ttl_s
                    continue
                holder = reply.holder
            log.error("lease %s lost (held by %s): stopping what it covered", name, holder)
            task.cancel()
            return True

    async def _claim(self, name: str, ttl_s: float) -> store_pb2.ClaimLeaseResponse:
        """Claims, renews or (ttl_s 0) releases: the replica's own turn-taking, so sent without
        the grant of a call it serves (the store takes leases from the services alone)."""
        without_grant = CURRENT_GRANT.set(None)
        try:
            return await self.store.claim_lease(name, self.holder, ttl_s)
        finally:
            CURRENT_GRANT.reset(without_grant)

    async def _release(self, name: str) -> None:
        try:
            await self._claim(name, 0.0)
        except ServiceError as exc:
            log.warning("lease %s not released (it expires by itself): %s", name, exc.message)
