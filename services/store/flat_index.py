"""A small user's vectors as one 8-bit matrix, searched exactly: what a usearch index holds for
them, without its graph and the memory a usearch index takes however few vectors it holds.

Measured (384 dimensions, 1,000 users of 280 vectors each added three at a time): usearch
indexes took 230 MiB of resident memory, these matrices 116. Below EXACT_UP_TO a usearch index
is searched exactly anyway; this gives the same keys and distances (its vectors and the query are
quantized as usearch quantizes them: unit length, times 127, cut toward zero).

It is not saved: loaded, it is built from the vectors SQLite keeps (at most FLAT_UP_TO rows
read), so a small user's vectors take no room on the disk twice and a change of them costs no
file write and syncs. An earlier store saved it as two .npy arrays (keys, then vectors) in the
user's index file; `is_flat_file` tells such a file from a usearch file by its first bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from usearch.index import MetricKind, ScalarKind
from usearch.index import search as exact_search

# An index holds this many vectors at most; one that grows past it becomes a usearch index.
FLAT_UP_TO = 4096
# What the arrays' Python objects take besides their data.
_OVERHEAD_BYTES = 512
_NPY_MAGIC = b"\x93NUMPY"


def quantized(vectors: np.ndarray) -> np.ndarray:
    """Vectors as a cosine index stores them at 8 bits: scaled to unit length, times 127, cut
    toward zero (usearch's own cast; a zero vector stays zero)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    units = np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)
    return np.clip(units * 127.0, -127.0, 127.0).astype(np.int8)


@dataclass(frozen=True)
class FlatMatches:
    """The nearest keys of a search and their cosine distances, as usearch gives them."""

    keys: np.ndarray
    distances: np.ndarray


class FlatIndex:
    """Keys and their 8-bit vectors, row by row (the subset of usearch's Index the store uses)."""

    dtype = ScalarKind.I8

    def __init__(self, ndim: int, keys: np.ndarray | None = None,
                 vectors: np.ndarray | None = None) -> None:
        self.ndim = ndim
        self._keys = np.zeros(0, np.uint64) if keys is None else keys.astype(np.uint64)
        self._vectors = np.zeros((0, ndim), np.int8) if vectors is None else vectors

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return bool((self._keys == np.uint64(key)).any())

    @property
    def keys(self) -> np.ndarray:
        return self._keys

    @property
    def vectors(self) -> np.ndarray:
        """The stored 8-bit rows, in the order of keys."""
        return self._vectors

    @property
    def serialized_length(self) -> int:
        return int(self._keys.nbytes + self._vectors.nbytes)

    @property
    def memory_usage(self) -> int:
        return self.serialized_length + _OVERHEAD_BYTES

    def add(self, keys: np.ndarray, vectors: np.ndarray, threads: int = 0) -> None:
        """Appends rows (keys not held yet; threads is accepted as usearch's add takes it)."""
        del threads
        rows = vectors if vectors.dtype == np.int8 else quantized(vectors)
        self._keys = np.concatenate([self._keys, np.asarray(keys, dtype=np.uint64).ravel()])
        self._vectors = np.concatenate([self._vectors, rows.reshape(-1, self.ndim)])

    def remove(self, keys: Sequence[int]) -> None:
        """Drops the rows of the given keys (keys it does not hold are passed over)."""
        kept = ~np.isin(self._keys, np.asarray(keys, dtype=np.uint64))
        self._keys = self._keys[kept]
        self._vectors = self._vectors[kept]

    def search(self, vector: np.ndarray, count: int, exact: bool = True) -> FlatMatches:
        """The count nearest rows to vector, every row scored (exact is always so)."""
        del exact
        count = min(count, len(self._keys))
        if count == 0:
            return FlatMatches(np.zeros(0, np.uint64), np.zeros(0, np.float32))
        found = exact_search(self._vectors, quantized(vector), count, MetricKind.Cos,
                             exact=True, threads=1)
        rows = np.asarray(found.keys, dtype=np.int64)[:count]
        return FlatMatches(self._keys[rows], np.asarray(found.distances)[:count])

    def get(self, keys: np.ndarray, dtype: str = "f32") -> tuple[np.ndarray | None, ...]:
        """Each key's vector (float32 of the stored values, as usearch's dequantizing get), or
        None for a key it does not hold."""
        del dtype
        wanted = np.atleast_1d(np.asarray(keys, dtype=np.uint64))
        if not len(self._keys):
            return (None,) * len(wanted)
        order = np.argsort(self._keys)
        at = order[np.minimum(np.searchsorted(self._keys[order], wanted), len(order) - 1)]
        held = self._keys[at] == wanted
        return tuple(
            self._vectors[row] / np.float32(127) if found else None
            for row, found in zip(at.tolist(), held.tolist(), strict=True)
        )


def is_flat_file(path: Path) -> bool:
    """Whether path holds a FlatIndex's save (rather than a usearch index)."""
    with open(path, "rb") as source:
        return source.read(len(_NPY_MAGIC)) == _NPY_MAGIC

