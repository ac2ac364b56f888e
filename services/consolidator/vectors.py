"""Fact and text vectors for a pass, each stored row embedded once per content."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from shared.pb import common_pb2

CHUNK = 256


class Embedder(Protocol):
    """What the pass needs from the embedder."""

    async def embed(
        self, texts: Sequence[str], *, is_query: bool = False
    ) -> tuple[np.ndarray, str]: ...


class Vectors:
    """Embeds texts and rows, remembering each row's vector while its content is unchanged."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self._rows: dict[tuple[str, str], np.ndarray] = {}

    async def of_texts(self, texts: Sequence[str]) -> np.ndarray:
        """One vector per text, in order."""
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        vectors, _ = await self.embedder.embed(list(texts))
        return vectors

    async def of_rows(self, rows: Sequence[common_pb2.Memory]) -> dict[str, np.ndarray]:
        """Each row's vector by id, embedding only the texts not seen before."""
        missing = [r for r in rows if (r.id, r.content) not in self._rows]
        for start in range(0, len(missing), CHUNK):
            chunk = missing[start : start + CHUNK]
            vectors = await self.of_texts([r.content for r in chunk])
            for row, vector in zip(chunk, vectors, strict=True):
                self._rows[(row.id, row.content)] = vector
        return {r.id: self._rows[(r.id, r.content)] for r in rows}
