"""Seeding both sides of bench/compare.py with the same vectors, without running the model.

Large sizes would take hours to embed on a small machine, for both sides alike, and the model's
cost is measured anyway on the adds each size times. So up to the measured tail, every LoCoMo
turn is embedded once; a memory of two turns gets the normalised sum of its turns' vectors, each
of its sentences its own turn's vector (a run of sentences from both turns, the memory's). Ours
imports them (with its sentence and context keys, as an ordinary write makes them); chromadb adds
them as embeddings.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

from services.store.keys import clauses, context_text


def b64(vector: np.ndarray) -> str:
    """A vector as the import format carries it: base64 of little-endian float32."""
    return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()


def _unit(vector: np.ndarray) -> np.ndarray:
    return vector / max(float(np.linalg.norm(vector)), 1e-12)


@dataclass
class Seeder:
    """The vectors of the memories, from the vectors of the turns they are made of."""

    turns: list[str]
    parts: list[tuple[int, int | None]]
    turn_vectors: np.ndarray
    model_id: str

    def vector(self, index: int) -> np.ndarray:
        """A memory's vector."""
        a, b = self.parts[index]
        if b is None:
            return self.turn_vectors[a]
        return _unit(self.turn_vectors[a] + self.turn_vectors[b])

    def _clause_vector(self, index: int, clause: str) -> np.ndarray:
        """A sentence key's vector: its turn's, or for a run of sentences that takes in the end
        of the first turn and the start of the second, the memory's. The model's pooled span of
        such a run (200 of them, 2026-12-05) has a cosine of 0.905 with the memory's vector and
        0.687 with the second turn's, which this gave before, tying the key with that turn's
        every copy though its text is in no other memory; a sentence inside one turn, 0.844
        with its turn's vector and 0.849 with the memory's."""
        a, b = self.parts[index]
        if b is None or clause in self.turns[a]:
            return self.turn_vectors[a]
        if clause in self.turns[b]:
            return self.turn_vectors[b]
        return self.vector(index)

    def matrix(self, lo: int, hi: int) -> str:
        """The vectors of memories lo..hi, for chromadb."""
        return b64(np.stack([self.vector(i) for i in range(lo, hi)]))

    def import_line(
        self, index: int, text: str, owner: str, before: str | None, after: str | None
    ) -> str:
        """One import line: the memory, its vector, its sentence keys and its context key."""
        keys: list[dict[str, str | None]] = [
            {"kind": "clause", "text": c, "vector": b64(self._clause_vector(index, c))}
            for c in clauses(text)
        ]
        keys.append({"kind": "context", "text": context_text(before, text, after), "vector": None})
        return json.dumps(
            {
                "type": "memory",
                "memory": {"id": f"m{index}", "user_id": owner, "content": text},
                "vector": b64(self.vector(index)),
                "model_id": self.model_id,
                "keys": keys,
            }
        )
