"""One extraction: gather what the model is shown, call it once, check its ops, apply them."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import numpy as np

from services.extractor.context import Context, read_context
from services.extractor.fact_ops import (
    OpBuilder,
    Turn,
    as_read,
    dated_ahead,
    page_name,
    page_ops,
    said_at,
)
from services.extractor.parse import (
    Candidate,
    Plan,
    read_plan,
)
from services.extractor.prompt import (
    EXTRACTION_SCHEMA,
    SYSTEM,
    cap_utf8,
    extraction_messages,
)
from services.extractor.reconcile import Reconciler
from shared.calibration import related_score
from shared.errors import (
    Conflict,
    InvalidArgument,
    PermissionDenied,
    ServiceError,
    Unavailable,
)
from shared.intentions import is_overdue
from shared.layers import DONE, EXPERIENCE, FAILED, SKIPPED
from shared.llm import LlmClient, LlmMalformed
from shared.pb import common_pb2, store_pb2
from shared.store_client import StoreClient, update_op
from shared.text import value_key
from shared.tombstones import tombstones

log = logging.getLogger(__name__)

ACTOR = "extractor"
MAX_INTENTIONS = 10
MAX_PAGES = 5
LEARNT_LAYERS = [common_pb2.L3_FACT, common_pb2.L7_INTENTION]
"""The layers an extraction writes values to that a re-extraction could write again."""
LATER_DECISIONS = frozenset(
    {"replaced", "updated", "merged", "restated", "dropped", "done", "forgotten"}
)
"""How a row is retired when the user or a later turn decided on its value ("stale" and
"undone" are not: they say the row's evidence or a consolidation pass went, not its value)."""
MAX_SENTENCES = 8
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def probe_texts(text: str) -> list[str]:
    """The turn and its first sentences: a fact related to one sentence of a long turn is
    related to the turn, even when the turn's single vector is pulled elsewhere by the rest."""
    sentences = [s.strip() for s in _SENTENCE_END.split(text) if len(s.strip()) >= 8]
    return [text, *[s for s in sentences[:MAX_SENTENCES] if s != text.strip()]]


class Embedder(Protocol):
    """What extraction needs from the embedder."""

    async def embed(
        self, texts: Sequence[str], *, is_query: bool = False
    ) -> tuple[np.ndarray, str]: ...


@dataclass
class Counters:
    """What extraction did since the service started."""

    extracted: int = 0
    failed: int = 0
    dropped_ops: int = 0
    refused_forgotten: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class Outcome:
    """How one extraction ended."""

    status: str
    error: str = ""
    also_refused: bool = False
    """The store refused the ops sent with the extraction (`also`): it was stored without them."""


def done_op(raw: common_pb2.Memory) -> store_pb2.Op:
    """Marks a turn extracted on condition that it is still as read: forgotten, edited or given
    tombstones meanwhile, the store refuses the whole extraction, so no fact of it stays live."""
    return store_pb2.Op(
        update=store_pb2.UpdateOp(id=raw.id, extraction_status=DONE, require=as_read(raw))
    )


def owner_scope(memory: common_pb2.Memory) -> common_pb2.Scope:
    """The scope of a row's owner (the store widens the user to its alias group)."""
    return common_pb2.Scope(user_id=memory.owner.user_id, agent_id=memory.owner.agent_id)


class Extraction:
    """Extracts raw rows into facts, preferences, intentions, pages and experiences."""

    def __init__(
        self,
        store: StoreClient,
        embedder: Embedder,
        llm: LlmClient,
        dedupe_score: float = 0.92,
        related_facts: int = 5,
        reconciler: Reconciler | None = None,
    ) -> None:
        self.store = store
        self.embedder = embedder
        self.llm = llm
        self.dedupe_score = dedupe_score
        self.related_facts = related_facts
        self.reconciler = reconciler
        self.counters = Counters()

    async def read_context(self, scope: common_pb2.Scope, memory_id: str) -> Context:
        """The row and everything its extraction is shown, in one store read."""
        return await read_context(
            self.store, scope, memory_id, self.related_facts, MAX_PAGES
        )

    async def extract(
        self, context: Context, now: datetime | None = None, also: Sequence[store_pb2.Op] = ()
    ) -> Outcome:
        """Extracts one live raw row, applying the ops `also` in the same transaction as its
        result (or, should the store refuse that write, without them: Outcome.also_refused);
        LlmUnavailable propagates and changes nothing."""
        raw = context.raw
        if raw.layer != common_pb2.L2_RAW or raw.status != "active":
            return Outcome(SKIPPED, "not a live raw row")
        today = now or said_at(raw)
        scope = owner_scope(raw)
        text = cap_utf8(raw.content)
        _, model_id, sentence_hits = await self._sentence_probes(context, text)
        candidates = self._candidates(context, text, sentence_hits, today.timestamp())
        messages = extraction_messages(text, today, candidates, dated_ahead(raw))
        try:
            reply = await self.llm.json_reply(messages, EXTRACTION_SCHEMA)
        except LlmMalformed as exc:
            await self.fail(raw, exc)
            return Outcome(FAILED, exc.message)
        plan = read_plan(reply, {c.number: c for c in candidates}, SYSTEM)
        self.counters.dropped_ops += plan.dropped
        ops = await self._ops(raw, plan, context.open_rows, await self._settled(raw))
        ops.append(done_op(raw))
        try:
            applied, also_refused = await self._store(scope, raw, ops, also)
        except Conflict as exc:  # the turn (or a row it retires, a page it updates) changed
            log.info("extraction of %s dropped: %s", raw.id, exc.message)
            return Outcome(SKIPPED, exc.message)
        self.counters.extracted += 1
        self.counters.last_error = ""  # the pipeline works again
        if self.reconciler is not None:
            await self._reconcile(scope, text, applied, model_id)
        return Outcome(DONE, also_refused=also_refused)

    async def _store(
        self,
        scope: common_pb2.Scope,
        raw: common_pb2.Memory,
        ops: list[store_pb2.Op],
        also: Sequence[store_pb2.Op],
    ) -> tuple[list[common_pb2.Memory], bool]:
        """Applies the extraction's ops with `also` in one transaction, and whether `also` was
        refused: a write the store refuses (PermissionDenied, InvalidArgument) with `also` is
        applied again without them, as an op beside the extraction never loses its facts; a
        refusal of the extraction's own ops comes back from that second write."""
        reason = f"extraction of {raw.id}"
        if also:
            try:
                return await self.store.apply(scope, [*ops, *also], ACTOR, reason), False
            except (PermissionDenied, InvalidArgument) as exc:
                log.warning("extraction of %s: the store refused the write with the ops beside "
                            "it (%s); writing the extraction without them", raw.id, exc.message)
        return await self.store.apply(scope, ops, ACTOR, reason), bool(also)

    async def _sentence_probes(
        self, context: Context, text: str
    ) -> tuple[np.ndarray, str, list[common_pb2.ScoredMemory]]:
        """The turn's vector (stored, or embedded when the store has none) and, for a turn of
        several sentences, the facts near each sentence."""
        raw, probes = context.raw, probe_texts(text)
        if context.vector is not None:
            own, model_id = context.vector[None, :], raw.model_id
        else:
            own, model_id = await self.embedder.embed(probes[:1])
        if len(probes) == 1:
            return own, model_id, []
        sentences, model_id = await self.embedder.embed(probes[1:])
        found = await asyncio.gather(*(
            self.store.vector_search(owner_scope(raw), v, model_id, [common_pb2.L3_FACT],
                                     self.related_facts, related_score(model_id))
            for v in sentences
        ))
        return own, model_id, [hit for hits in found for hit in hits]

    async def _reconcile(
        self,
        scope: common_pb2.Scope,
        text: str,
        applied: Sequence[common_pb2.Memory],
        model_id: str,
    ) -> None:
        """The second call; the extraction already stands, so a failure here is only logged."""
        assert self.reconciler is not None
        facts = [
            m
            for m in applied
            if m.layer == common_pb2.L3_FACT and m.label != EXPERIENCE and m.status == "active"
        ]
        if not facts:
            return
        try:
            vectors, _ = await self.embedder.embed([m.content for m in facts])
            await self.reconciler.reconcile(scope, text, facts, list(vectors), model_id)
        except ServiceError as exc:  # the LLM's failures, a busy embedder, a fact gone since
            log.warning("reconcile skipped: %s", exc.message)
        except Exception:  # a bug: logged whole; the extraction stands and is not failed
            log.exception("reconcile of %d facts failed; the extraction stands", len(facts))
        finally:
            self.counters.dropped_ops += self.reconciler.dropped
            self.reconciler.dropped = 0

    async def fail(self, raw: common_pb2.Memory, exc: Exception) -> None:
        """Marks a row failed after exc. Every failure counts a try but Unavailable (the model,
        the embedder or the store unreachable or overloaded): that one says nothing of the row,
        while any other would recur each run, so catch-up gives up on it after its tries."""
        error = exc.message if isinstance(exc, ServiceError) else str(exc) or type(exc).__name__
        fields: dict[str, Any] = {"extraction_status": FAILED}
        if not isinstance(exc, Unavailable):
            fields["extraction_tries"] = raw.extraction_tries + 1
        await self.store.apply(
            owner_scope(raw), [update_op(raw.id, **fields)], ACTOR,
            f"extraction failed: {error}"[:500],
        )
        self.counters.failed += 1
        self.counters.last_error = error

    def _candidates(
        self,
        context: Context,
        text: str,
        sentence_hits: Sequence[common_pb2.ScoredMemory],
        now: float,
    ) -> list[Candidate]:
        """Related facts, open intentions (those not overdue at now first, so overdue ones
        do not crowd them out) and touched pages, numbered 1, 2, ..."""
        best: dict[str, common_pb2.ScoredMemory] = {}
        for hit in (*context.facts, *sentence_hits):
            if hit.memory.id not in best or hit.score > best[hit.memory.id].score:
                best[hit.memory.id] = hit
        facts = sorted(best.values(), key=lambda h: h.score, reverse=True)[: self.related_facts]
        intentions = sorted(
            (r for r in context.open_rows if r.layer == common_pb2.L7_INTENTION),
            key=lambda r: r.HasField("due_at") and is_overdue(r.due_at, r.utc_offset_minutes, now),
        )
        rows: list[tuple[str, common_pb2.Memory]] = [
            *(("fact", hit.memory) for hit in facts),
            *(("intention", m) for m in intentions[:MAX_INTENTIONS]),
            *(("page", m) for m in _touched_pages(context, text)),
        ]
        return [Candidate(i, kind, m) for i, (kind, m) in enumerate(rows, start=1)]

    async def _settled(self, raw: common_pb2.Memory) -> frozenset[str]:
        """Value keys of the rows learnt from raw before that are live or that a later
        decision retired: a re-extraction does not write them again (a first one has none)."""
        if raw.extraction_status not in (DONE, FAILED):
            return frozenset()
        rows = await self.store.all_rows(store_pb2.ListMemoriesRequest(
            scope=owner_scope(raw), layers=LEARNT_LAYERS, include_superseded=True,
            source_id=raw.id,
        ))
        return frozenset(
            value_key(r.content)
            for r in rows
            if r.status == "active" or r.superseded_how in LATER_DECISIONS
        )

    async def _ops(
        self,
        raw: common_pb2.Memory,
        plan: Plan,
        open_rows: Sequence[common_pb2.Memory],
        settled: frozenset[str],
    ) -> list[store_pb2.Op]:
        """The store ops a checked plan turns into (inserts first, then retirements)."""
        pages = [r for r in open_rows if r.layer == common_pb2.L8_ENTITY]
        intentions = frozenset(
            value_key(r.content) for r in open_rows if r.layer == common_pb2.L7_INTENTION
        )
        refused = set(tombstones(raw.metadata_json))
        new_texts = [f.text for f in plan.facts] + plan.experiences
        (vectors, vectors_model), (refused_vectors, _) = await asyncio.gather(
            self._embed(new_texts), self._embed(sorted(refused))
        )
        builder = OpBuilder(
            Turn(raw, refused, refused_vectors, vectors, vectors_model, self.dedupe_score,
                 intentions, settled)
        )
        builder.add_facts(plan)
        builder.add_experiences(plan)
        builder.add_intentions(plan)
        if builder.refused_count:
            self.counters.refused_forgotten += builder.refused_count
            log.info("refused %d forgotten values from raw row %s", builder.refused_count, raw.id)
        known = {page_name(p).casefold(): p for p in pages}
        return builder.all_ops(page_ops(builder, plan.pages, known))

    async def _embed(self, texts: Sequence[str]) -> tuple[np.ndarray, str]:
        return await self.embedder.embed(texts) if texts else (np.zeros((0, 1)), "")


def _touched_pages(context: Context, text: str) -> list[common_pb2.Memory]:
    """Pages whose entity the turn names, then pages close to the turn in meaning."""
    lowered = text.casefold()
    pages = [r for r in context.open_rows if r.layer == common_pb2.L8_ENTITY]
    chosen = {
        p.id: p
        for p in pages
        if (name := page_name(p))
        and re.search(r"(?<!\w)" + re.escape(name.casefold()) + r"(?!\w)", lowered)
    }
    for hit in context.near_pages:
        chosen.setdefault(hit.memory.id, hit.memory)
    return list(chosen.values())[:MAX_PAGES]

