"""One search from query to channels: retrieval from the sources, then the ranking pipeline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.search import channels, stages
from services.search.graph import GraphEdge, graph_names, linked_memory_ids
from services.search.model import (
    KEYWORD,
    VECTOR,
    Candidate,
    RankingSettings,
    Scope,
    SearchContext,
    SearchQuery,
)
from services.search.pipeline import PLAIN_PIPELINE, Pipeline
from services.search.switches import CONTEXT_KEYS, GRAPH, RELAXED_KEYWORDS
from shared.calibration import calibrated_floor

log = logging.getLogger(__name__)

# The most live edges graph-assisted recall looks through for one query.
GRAPH_EDGE_WINDOW = 1000
# The most facts shown behind one schema.
MAX_EVIDENCE = 10
# How many of the owner's newest open intentions are looked at for those due soon.
OPEN_INTENTIONS = 100
# How many hits of each source the full ranking asks for: scores are summed, so a memory
# one source ranks well should have its score from the others too.
FULL_POOL = 50


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

    async def cosines(
        self, scope: Scope, vector: Sequence[float], model_id: str, ids: Sequence[str]
    ) -> dict[str, float]:
        """The cosine of each of these memories (its nearest key) with vector; one without a
        vector, or out of scope, is left out."""
        ...

    async def keyword_search(
        self,
        scope: Scope,
        text: str,
        layers: Sequence[str],
        k: int,
        *,
        relaxed: bool = False,
        context: bool = False,
    ) -> tuple[list[Candidate], list[Candidate]]:
        """Live memories holding the query's terms, and those whose context key holds them."""
        ...

    async def newest(
        self, scope: Scope, layers: Sequence[str], k: int, label: str = ""
    ) -> list[Candidate]:
        """The k newest live memories of the layers (with that label, if one is given)."""
        ...

    async def live_edges(self, scope: Scope, limit: int) -> list[GraphEdge]:
        """The scope's live L5 edges."""
        ...

    async def memories(self, scope: Scope, ids: Sequence[str]) -> list[Candidate]:
        """The live memories with these ids, in order; missing or retired ones left out."""
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
        graph_recall: bool = False,
        settings: RankingSettings | None = None,
        disabled: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._backend = backend
        self._pipeline = pipeline
        self._settings = settings or RankingSettings()
        self._disabled = disabled
        self._model_floor = calibrated_floor("")
        self._intention_ttl_s = intention_ttl_s
        self._now_pages = now_pages
        self._graph_recall = graph_recall
        self._clock = clock

    async def search(self, query: SearchQuery) -> SearchResult:
        """Asks every source the reader names, concurrently, then ranks what they found."""
        started = time.perf_counter()
        timings: dict[str, float] = {}
        off = self._disabled | query.skip_stages
        found = await asyncio.gather(
            self._vector(query, timings),
            self._keyword(query, off, timings),
            self._timed(timings, "now_page", self._newest_summaries(query)),
            self._timed(timings, GRAPH, self._graph(query, off)),
            self._timed(timings, "due_soon", self._open_intentions(query)),
        )
        (vector, model_floor, asked), (keyword, around), newest, graph, open_ = found
        if graph:
            await self._timed(timings, "graph_cosines", self._graph_cosines(query, graph, asked))
        retrieved = time.perf_counter()
        ctx = SearchContext(
            query=query,
            vector=vector,
            keyword=keyword,
            now=self._clock(),
            intention_ttl_s=self._intention_ttl_s,
            context=around,
            settings=self._settings,
            model_floor=model_floor,
            graph=graph,
        )
        pipeline = PLAIN_PIPELINE if query.plain else self._pipeline
        ranked, stage_timings = pipeline.run(ctx)
        now_page = channels.pick_now_page(newest)
        arranged = channels.arrange(ranked)
        channels.add_proactive(arranged, stages.due_soon(open_, ctx.now))
        await self._timed(timings, "evidence", self._add_evidence(query, arranged))
        result = SearchResult(
            channels=arranged,
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

    async def _vector(
        self, query: SearchQuery, timings: dict[str, float]
    ) -> tuple[list[Candidate], float, tuple[Sequence[float], str] | None]:
        """The vector source's hits, the model's floor, and the query's vector with its model
        (None when the reader asks no vector source)."""
        if VECTOR not in query.sources:
            return [], self._model_floor, None
        started = time.perf_counter()
        vector, model_id = await self._backend.embed_query(query.text)
        embedded = time.perf_counter()
        pool = query.pool if query.plain else max(query.pool, FULL_POOL)
        hits = await self._backend.vector_search(query.scope, vector, model_id, query.layers, pool)
        timings["embed"] = (embedded - started) * 1000.0
        timings[VECTOR] = (time.perf_counter() - embedded) * 1000.0
        return hits, calibrated_floor(model_id), (vector, model_id)

    async def _graph_cosines(
        self,
        query: SearchQuery,
        graph: list[Candidate],
        asked: tuple[Sequence[float], str] | None,
    ) -> list[Candidate]:
        """Gives the memories graph recall found their cosine with the query (what a result's
        score shows), in one store call; without a query vector they keep none."""
        if asked is None:
            return graph
        vector, model_id = asked
        ids = [c.memory_id for c in graph]
        cosines = await self._backend.cosines(query.scope, vector, model_id, ids)
        for candidate in graph:
            candidate.cosine = cosines.get(candidate.memory_id, candidate.cosine)
        return graph

    async def _keyword(
        self, query: SearchQuery, off: frozenset[str], timings: dict[str, float]
    ) -> tuple[list[Candidate], list[Candidate]]:
        if KEYWORD not in query.sources:
            return [], []
        started = time.perf_counter()
        full = not query.plain
        found = await self._backend.keyword_search(
            query.scope,
            query.text,
            query.layers,
            max(query.pool, FULL_POOL) if full else query.pool,
            relaxed=full and RELAXED_KEYWORDS not in off,
            # Context keys serve the hybrid; the keyword reader stays a memory-text baseline.
            context=full and VECTOR in query.sources and CONTEXT_KEYS not in off,
        )
        timings[KEYWORD] = (time.perf_counter() - started) * 1000.0
        return found

    async def _graph(self, query: SearchQuery, off: frozenset[str]) -> list[Candidate]:
        # Lite mode writes no edges, so it makes no store call.
        if not self._graph_recall or query.plain or GRAPH in off:
            return []
        edges = await self._backend.live_edges(query.scope, GRAPH_EDGE_WINDOW)
        if not edges:
            return []
        ids = linked_memory_ids(edges, graph_names(query.text, edges))
        if not ids:
            return []
        return await self._backend.memories(query.scope, ids)

    async def _add_evidence(
        self, query: SearchQuery, arranged: dict[str, list[Candidate]]
    ) -> list[Candidate]:
        """Gives each L6 schema of the profile channel the live facts it was drawn from."""
        schemas = [c for c in arranged[channels.PROFILE] if c.layer == "l6_schema"]
        wanted = {c.memory_id: c.source_ids[:MAX_EVIDENCE] for c in schemas if c.source_ids}
        if not wanted:
            return []
        every = list(dict.fromkeys(i for ids in wanted.values() for i in ids))
        found = {c.memory_id: c for c in await self._backend.memories(query.scope, every)}
        for schema in schemas:
            schema.evidence = [found[i] for i in wanted.get(schema.memory_id, []) if i in found]
        return schemas

    async def _open_intentions(self, query: SearchQuery) -> list[Candidate]:
        # Only the LLM modes write intentions; a search of other layers does not want them.
        if not self._now_pages or (query.layers and "l7_intention" not in query.layers):
            return []
        return await self._backend.newest(query.scope, ["l7_intention"], OPEN_INTENTIONS)

    async def _newest_summaries(self, query: SearchQuery) -> list[Candidate]:
        # Only the LLM modes write Now pages; lite skips the store call.
        if not self._now_pages:
            return []
        # The newest Now page however many episode summaries came after it.
        return await self._backend.newest(
            query.scope, ["l4_summary"], 1, label=channels.NOW_PAGE_LABEL
        )
