"""An OpenAI-compatible embeddings endpoint, called over HTTP with aiohttp."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import numpy as np

from shared.errors import Unavailable

log = logging.getLogger(__name__)


class RemoteEncoder:
    """POSTs texts to {base}/embeddings and returns the rows L2-normalised, in order."""

    def __init__(
        self, session: aiohttp.ClientSession, base: str, model: str, key: str, timeout_s: float
    ) -> None:
        self._session = session
        self._url = base.rstrip("/") + "/embeddings"
        self._model = model
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.model = model
        self.ndim: int | None = None
        """Learnt from the first answer; the endpoint decides it."""

    async def encode(self, texts: Sequence[str]) -> np.ndarray:
        """One unit row per text, in order; endpoint failures are Unavailable."""
        if not texts:
            return np.zeros((0, self.ndim or 0), dtype=np.float32)
        body = {"model": self._model, "input": list(texts)}
        try:
            async with self._session.post(
                self._url, json=body, headers=self._headers, timeout=self._timeout
            ) as reply:
                if reply.status != 200:
                    detail = (await reply.text())[:300]
                    raise Unavailable(
                        f"embedding endpoint {self._url} answered {reply.status}: {detail}"
                    )
                payload = await reply.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Unavailable(f"embedding endpoint {self._url} failed: {exc!r}") from exc
        vectors = self._rows(payload, len(texts))
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        if np.any(norms == 0):
            raise Unavailable(f"embedding endpoint {self._url} returned a zero vector")
        return vectors / norms

    def _rows(self, payload: Any, count: int) -> np.ndarray:
        try:
            items = sorted(payload["data"], key=lambda item: item.get("index", 0))
            rows = np.array([item["embedding"] for item in items], dtype=np.float32)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise Unavailable(
                f"embedding endpoint {self._url} sent a malformed answer: {exc!r}"
            ) from exc
        if rows.ndim != 2 or rows.shape[0] != count or rows.shape[1] == 0:
            raise Unavailable(f"embedding endpoint {self._url} sent {rows.shape} for {count} texts")
        if self.ndim is None:
            self.ndim = int(rows.shape[1])
            log.info("remote model %s gives %d-d vectors", self.model, self.ndim)
        elif rows.shape[1] != self.ndim:
            raise Unavailable(
                f"embedding endpoint {self._url} changed dimension {self.ndim} -> {rows.shape[1]}"
            )
        return rows


@contextlib.asynccontextmanager
async def opened_remote_encoder(
    base: str, model: str, key: str, timeout_s: float
) -> AsyncIterator[RemoteEncoder]:
    """A RemoteEncoder whose HTTP session closes on exit."""
    async with aiohttp.ClientSession() as session:
        yield RemoteEncoder(session, base, model, key, timeout_s)
