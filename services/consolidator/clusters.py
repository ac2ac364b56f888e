"""Topic clusters of an owner's facts: built once, grown by nearest neighbour, due when changed."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

JOIN_SCORE = 0.55


def members_hash(members: Sequence[str]) -> str:
    """A fingerprint of a member set (order does not matter)."""
    return hashlib.sha1("\n".join(sorted(members)).encode()).hexdigest()[:16]


@dataclass
class Cluster:
    """One topic cluster and its progress."""

    id: int
    members: list[str] = field(default_factory=list)
    done: str = ""
    """The member hash at the last successful call ("" never)."""
    fails: int = 0
    """Failed passes in a row."""
    skip_until: float = 0.0
    skip_hash: str = ""

    @property
    def hash(self) -> str:
        """The fingerprint of the current members."""
        return members_hash(self.members)

    def due(self) -> bool:
        """Whether its members changed since its last successful call (one fact is no topic)."""
        return len(self.members) >= 2 and self.hash != self.done

    def skipped(self, now: float) -> bool:
        """Whether three failed passes keep it out until its members change or a day passes."""
        return self.skip_until > now and self.skip_hash == self.hash

    def to_json(self) -> dict[str, Any]:
        """The state value the store keeps."""
        return {
            "id": self.id,
            "members": self.members,
            "done": self.done,
            "fails": self.fails,
            "skip_until": self.skip_until,
            "skip_hash": self.skip_hash,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Cluster:
        """Reads a stored state value."""
        return cls(
            id=int(value["id"]),
            members=[str(m) for m in value.get("members", [])],
            done=str(value.get("done", "")),
            fails=int(value.get("fails", 0)),
            skip_until=float(value.get("skip_until", 0.0)),
            skip_hash=str(value.get("skip_hash", "")),
        )


def assign(
    clusters: list[Cluster],
    fact_ids: Sequence[str],
    vectors: Mapping[str, np.ndarray],
    batch: int,
    next_id: int,
) -> tuple[list[Cluster], int]:
    """Drops gone members and places new facts (oldest first); returns clusters and next id.

    A new fact joins the cluster of its nearest clustered neighbour at JOIN_SCORE or more when
    that cluster has room, otherwise the newest cluster with room, otherwise a new cluster.
    """
    live = set(fact_ids)
    for cluster in clusters:
        cluster.members = [m for m in cluster.members if m in live]
    clusters = [c for c in clusters if c.members]
    home: dict[str, Cluster] = {m: c for c in clusters for m in c.members}
    placed = [m for m in home if m in vectors]
    matrix = np.array([vectors[m] for m in placed], dtype=np.float32) if placed else None
    for fact_id in fact_ids:
        if fact_id in home or fact_id not in vectors:
            continue
        target: Cluster | None = None
        vector = vectors[fact_id]
        if matrix is not None:
            scores = matrix @ vector
            best = int(np.argmax(scores))
            near = home[placed[best]]
            if scores[best] >= JOIN_SCORE and len(near.members) < batch:
                target = near
        if target is None and clusters and len(clusters[-1].members) < batch:
            target = clusters[-1]
        if target is None:
            target = Cluster(id=next_id)
            next_id += 1
            clusters.append(target)
        target.members.append(fact_id)
        home[fact_id] = target
        placed.append(fact_id)
        row = vector[None, :].astype(np.float32)
        matrix = row if matrix is None else np.vstack([matrix, row])
    return clusters, next_id


def rebuilt(
    old: list[Cluster],
    fact_ids: Sequence[str],
    vectors: Mapping[str, np.ndarray],
    batch: int,
) -> list[Cluster]:
    """Clusters built afresh; one whose members equal an old cluster's keeps its progress."""
    fresh, _ = assign([], fact_ids, vectors, batch, 1)
    progress = {c.hash: c for c in old}
    for cluster in fresh:
        before = progress.get(cluster.hash)
        if before is not None:
            cluster.done, cluster.fails = before.done, before.fails
            cluster.skip_until, cluster.skip_hash = before.skip_until, before.skip_hash
    return fresh


def median(values: Sequence[float]) -> float:
    """The median (0 for none)."""
    return float(np.median(values)) if len(values) else 0.0
