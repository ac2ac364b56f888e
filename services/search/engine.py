"""One search from query to channels: retrieval from the sources, then the ranking pipeline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.search import channels
from services.search.model import KEYWORD, VECTOR, Candidate, Scope, SearchContext, SearchQuery
from services.search.pipeline import Pipeline

log = logging.getLogger(__name__)

# L4 holds episode summaries next to the Now page; this many newest rows are looked through.
NOW_PAGE_WINDOW = 20


class SearchBackend(Protocol):
    """The services a search reads from: the embedder and the store."""

    async def embed_query(self, text: str) -> tuple[Sequence[float], str]:
        """The query's vector and the model id that made it."""
        ...

    async def vector_search(
        self, scope: Scope, vector: Sequence[float], model_id: str, layers: Sequence[str], k: int
    ) -> list[Candidate]:
        """The k nearest live memories, best first, with their cosine, unfloored."""
        ...

    async def keyword_search(
        self, scope: Scope, text: str, layers: Sequence[str], k: int
    ) -> list[Candidate]:
        """Up to k live memories holding the query's terms, best first."""
        ...

    async def newest(self, scope: Scope, layers: Sequence[str], k: int) -> list[Candidate]:
        """The k newest live memories of the layers."""
        ...


@dataclass(frozen=True)
class SearchResult:
    """Ranked results by channel, the display order, and the owner's Now page."""

    channels: dict[str, list[Candidate]]
    order: list[str]
    now: Candidate | None


class SearchEngine:
    """Runs searches against a backend with one ranking pipeline."""

    def __init__(
        self,
        backend: SearchBackend,
        pipeline: Pipeline,
        *,
        intention_ttl_s: float | None,
        now_pages: bool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._backend = backend
        self._pipeline = pipeline
        self._intention_ttl_s = intention_ttl_s
        self._now_pages = now_pages
        self._clock = clock

    async def search(self, query: SearchQuery) -> SearchResult:
        """Asks every source the reader names, concurrently, then ranks what they found."""
        started = time.perf_counter()
        timings: dict[str, float] = {}
        vector, keyword, newest = await asyncio.gather(
            self._vector(query, timings),
            self._timed(timings, KEYWORD, self._keyword(query)),
            self._timed(timings, "now_page", self._newest_summaries(query)),
        )
        retrieved = time.perf_counter()
        ctx = SearchContext(
            query=query,
            vector=vector,
            keyword=keyword,
            now=self._clock(),
            intention_ttl_s=self._intention_ttl_s,
        )
        ranked, stage_timings = self._pipeline.run(ctx)
        now_page = channels.pick_now_page(newest)
        result = SearchResult(
            channels=channels.arrange(ranked),
            order=channels.display_order(now_page is not None),
            now=now_page,
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "search user=%s sources=%s vector=%d keyword=%d results=%d total=%.1fms "
                "retrieval=%.1fms [%s] stages [%s]",
                query.scope.user_id,
                "+".join(query.sources),
                len(vector),
                len(keyword),
                len(ranked),
                (time.perf_counter() - started) * 1000.0,
                (retrieved - started) * 1000.0,
                " ".join(f"{name}={ms:.1f}ms" for name, ms in timings.items()),
                " ".join(f"{t.name}={t.ms:.2f}ms/{t.count}" for t in stage_timings),
            )
        return result

    @staticmethod
    async def _timed(
        timings: dict[str, float], name: str, work: Awaitable[list[Candidate]]
    ) -> list[Candidate]:
        started = time.perf_counter()
        result = await work
        timings[name] = (time.perf_counter() - started) * 1000.0
        return result

    async def _vector(self, query: SearchQuery, timings: dict[str, float]) -> list[Candidate]:
        if VECTOR not in query.sources:
            return []
        started = time.perf_counter()
        vector, model_id = await self._backend.embed_query(query.text)
        embedded = time.perf_counter()
        hits = await self._backend.vector_search(
            query.scope, vector, model_id, query.layers, query.pool
        )
        timings["embed"] = (embedded - started) * 1000.0
        timings[VECTOR] = (time.perf_counter() - embedded) * 1000.0
        return hits

    async def _keyword(self, query: SearchQuery) -> list[Candidate]:
        if KEYWORD not in query.sources:
            return []
        return await self._backend.keyword_search(query.scope, query.text, query.layers, query.pool)

    async def _newest_summaries(self, query: SearchQuery) -> list[Candidate]:
        # Only the LLM modes write Now pages; lite skips the store call.
        if not self._now_pages:
            return []
        return await self._backend.newest(query.scope, ["l4_summary"], NOW_PAGE_WINDOW)
