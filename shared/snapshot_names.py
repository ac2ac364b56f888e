"""Snapshot file names: the store writes them, prunes by them and the gateway lists them."""

from __future__ import annotations

import re
from datetime import UTC, datetime

# Only a name the store wrote is a snapshot: a user's hyatlas-before-upgrade.zip beside them is
# neither listed nor pruned.
_SNAPSHOT = re.compile(r"hyatlas-\d{8}T\d{6}\.\d{6}Z\.zip")


def snapshot_name(at: datetime) -> str:
    """hyatlas-<UTC time>.zip; names sort in time order."""
    return f"hyatlas-{at.astimezone(UTC):%Y%m%dT%H%M%S.%f}Z.zip"


def is_snapshot_name(name: str) -> bool:
    """Whether name is one snapshot_name writes."""
    return _SNAPSHOT.fullmatch(name) is not None


def snapshot_time(name: str) -> datetime:
    """When the snapshot of a name snapshot_name wrote was taken."""
    return datetime.strptime(name, "hyatlas-%Y%m%dT%H%M%S.%fZ.zip").replace(tzinfo=UTC)
