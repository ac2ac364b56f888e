"""The "local" stub: deterministic, non-semantic vectors from hashed word features."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

HASH_MODEL_ID = "local-hash-384"
HASH_NDIM = 384
_WORD = re.compile(r"\w+")


def _feature(token: str, ndim: int) -> tuple[int, float]:
    # blake2b, not hash(): the same text must give the same vector in every process.
    digest = hashlib.blake2b(token.encode("utf-8"), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    return value % ndim, 1.0 if (value >> 32) & 1 else -1.0


class HashEncoder:
    """Maps words and word pairs of a text to signed buckets of a 384-d unit vector."""

    def __init__(self, ndim: int = HASH_NDIM) -> None:
        self.ndim = ndim

    def encode_one(self, text: str) -> np.ndarray:
        """The unit vector of one text; the empty text gets a fixed vector of its own."""
        words = _WORD.findall(text.lower())
        tokens = [*words, *(f"{a} {b}" for a, b in zip(words, words[1:], strict=False))]
        vector = np.zeros(self.ndim, dtype=np.float32)
        for token in tokens or ["\x00empty"]:
            index, sign = _feature(token, self.ndim)
            vector[index] += sign
        norm = float(np.linalg.norm(vector))
        if norm == 0.0:
            # Features that cancel out; fall back to the text's own bucket so the row stays unit.
            index, sign = _feature("\x00text " + text, self.ndim)
            vector[index] = sign
            norm = 1.0
        return vector / norm

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """One unit row per text, in order."""
        out = np.zeros((len(texts), self.ndim), dtype=np.float32)
        for row, text in enumerate(texts):
            out[row] = self.encode_one(text)
        return out
