"""The embedder's domain: request limits, query prefixes, the backends behind the batcher, and
the set of models it can run."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.embedder.batcher import MicroBatcher, OnIdle
from services.embedder.config import EmbedderConfig
from services.embedder.hash_encoder import HASH_MODEL_ID, HashEncoder
from services.embedder.models import (
    ModelFiles,
    default_model_files,
    find_model_files,
    model_files_in,
)
from services.embedder.onnx_encoder import RUN_TOKENS, OnnxEncoder
from services.embedder.remote_encoder import opened_remote_encoder
from shared.clients import MAX_TEXTS
from shared.errors import ConfigError, InvalidArgument, NotFound
from shared.limits import MAX_EMBED_CHARS
from shared.passages import Passage, row_texts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What DescribeModel reports."""

    model_id: str
    ndim: int
    semantic: bool
    pooling: str
    """mean, cls, hash (the local stub) or remote."""
    max_tokens: int
    query_prefix: str = ""


def rows_in_call_order(order: Sequence[int], rows_of: Sequence[int]) -> np.ndarray:
    """Where each row of a call lies among the rows of its passages taken in order (passage
    order[0] first), a passage giving rows_of[passage] consecutive rows."""
    starts = np.zeros(len(order), dtype=np.int64)
    starts[order] = np.cumsum([0, *(rows_of[i] for i in order[:-1])])
    return np.concatenate(
        [np.arange(start, start + count) for start, count in zip(starts, rows_of, strict=True)]
    )


def check_passages(passages: Sequence[Passage]) -> None:
    """Refuses a request over the size limits or with a span outside its text, naming it."""
    if len(passages) > MAX_TEXTS:
        raise InvalidArgument(f"{len(passages)} texts in one request; at most {MAX_TEXTS}")
    spans = sum(len(p.spans) for p in passages)
    if spans > MAX_TEXTS:
        raise InvalidArgument(f"{spans} spans in one request; at most {MAX_TEXTS}")
    for index, passage in enumerate(passages):
        if len(passage.text) > MAX_EMBED_CHARS:
            raise InvalidArgument(
                f"texts[{index}] has {len(passage.text)} characters; at most {MAX_EMBED_CHARS}"
            )
        for start, end in passage.spans:
            if not 0 <= start < end <= len(passage.text):
                raise InvalidArgument(
                    f"span [{start}, {end}) lies outside texts[{index}] "
                    f"({len(passage.text)} characters)"
                )


class Embedder:
    """Embeds texts through a micro-batcher and knows which model does it."""

    def __init__(
        self,
        batcher: MicroBatcher[Passage],
        info: ModelInfo,
        describe: Callable[[], Awaitable[ModelInfo]] | None = None,
    ) -> None:
        self._batcher = batcher
        self._info = info
        self._describe = describe

    @property
    def batcher(self) -> MicroBatcher[Passage]:
        """The batcher (its counters say how calls were coalesced)."""
        return self._batcher

    async def describe(self) -> ModelInfo:
        """The model in use; a remote model's dimension is learnt on first use."""
        return await self._describe() if self._describe else self._info

    async def embed(self, texts: Sequence[str], *, is_query: bool = False) -> np.ndarray:
        """Unit float32 rows for texts, in order; queries get the model's query prefix."""
        if is_query and self._info.query_prefix:
            texts = [self._info.query_prefix + text for text in texts]
        return await self.embed_passages([Passage(text) for text in texts], urgent=is_query)

    async def embed_passages(
        self, passages: Sequence[Passage], *, urgent: bool = False, bulk: bool = False
    ) -> np.ndarray:
        """Unit float32 rows for each passage in order: its text's, then each span's.

        A call's passages go to the batcher shortest first: a long call is run max_batch texts
        at a time, and texts of about one length in a run pad little. Urgent ones (queries)
        run before the writes' texts queued, bulk ones after them (see MicroBatcher).
        """
        check_passages(passages)
        if not passages:
            return np.zeros((0, self._info.ndim), dtype=np.float32)
        order = sorted(range(len(passages)), key=lambda i: len(passages[i].text))
        rows = await self._batcher.embed([passages[i] for i in order], urgent=urgent, bulk=bulk)
        return rows[rows_in_call_order(order, [p.rows for p in passages])]

    @property
    def model_id(self) -> str:
        """The id recorded next to every vector this embedder makes."""
        return self._info.model_id


def _batcher(
    run: Callable[[list[Passage]], Awaitable[np.ndarray]],
    config: EmbedderConfig,
    tokens_of: Callable[[Passage], int] | None = None,
    on_idle: OnIdle | None = None,
) -> MicroBatcher[Passage]:
    """The batcher of one model. Its runs in flight share RUN_TOKENS, so that the model's
    working memory is bounded as for one run."""
    return MicroBatcher(
        run,
        config.max_batch,
        rows_of=lambda passage: passage.rows,
        max_queue=config.max_queue,
        tokens_of=tokens_of,
        max_tokens=RUN_TOKENS // config.runs,
        on_idle=on_idle,
        runs=config.runs,
    )


@contextlib.asynccontextmanager
async def opened_embedder(config: EmbedderConfig) -> AsyncIterator[Embedder]:
    """The configured backend behind a running batcher; a missing model is a ConfigError."""
    async with contextlib.AsyncExitStack() as stack:
        if config.backend == "local":
            hasher = HashEncoder()
            info = ModelInfo(HASH_MODEL_ID, hasher.ndim, False, "hash", 0)

            async def run_hash(passages: list[Passage]) -> np.ndarray:
                return hasher.encode(row_texts(passages))

            batcher = await stack.enter_async_context(_batcher(run_hash, config))
            yield Embedder(batcher, info)
        elif config.backend == "remote":
            remote = await stack.enter_async_context(
                opened_remote_encoder(
                    config.remote_base,
                    config.remote_model,
                    config.remote_key,
                    config.remote_timeout_s,
                )
            )
            async def run_remote(passages: list[Passage]) -> np.ndarray:
                return await remote.encode(row_texts(passages))

            batcher = await stack.enter_async_context(_batcher(run_remote, config))
            remote_info = ModelInfo(f"remote:{config.remote_model}", 0, True, "remote", 0)

            async def describe_remote() -> ModelInfo:
                if remote.ndim is None:
                    await batcher.embed([Passage("dimension probe")])
                return ModelInfo(remote_info.model_id, remote.ndim or 0, True, "remote", 0)

            yield Embedder(batcher, remote_info, describe_remote)
        else:
            files = await asyncio.to_thread(find_model_files, config.model_dir)
            yield await stack.enter_async_context(opened_onnx(files, config))


@contextlib.asynccontextmanager
async def opened_onnx(files: ModelFiles, config: EmbedderConfig) -> AsyncIterator[Embedder]:
    """One ONNX model behind its own batcher."""
    encoder = await asyncio.to_thread(OnnxEncoder, files, config.threads, config.pooled_spans)
    spec = encoder.spec
    info = ModelInfo(
        spec.model_id, spec.ndim, True, spec.pooling, spec.max_tokens, spec.query_prefix
    )

    async def run_onnx(passages: list[Passage]) -> np.ndarray:
        return await asyncio.to_thread(encoder.encode_passages, passages)

    async def give_back() -> None:
        if encoder.holding:
            await asyncio.to_thread(encoder.give_back)

    async with _batcher(run_onnx, config, encoder.tokens_guess, give_back) as batcher:
        yield Embedder(batcher, info)


Opener = Callable[[], contextlib.AbstractAsyncContextManager[Embedder]]


class ModelSet:
    """The models an embedder runs, by id: the configured one, always loaded, and others it
    loads when named (the model a store's vectors still come from, during a re-embed)."""

    def __init__(self, configured: Embedder, others: Mapping[str, Opener]) -> None:
        self.configured = configured
        self._others = {k: v for k, v in others.items() if k != configured.model_id}
        self._loaded: dict[str, tuple[Embedder, contextlib.AsyncExitStack]] = {}
        self._serving = configured.model_id
        self._lock = asyncio.Lock()

    @property
    def serving(self) -> str:
        """The model calls that name none get."""
        return self._serving

    async def get(self, model_id: str = "") -> Embedder:
        """The named model (loaded now if need be), or the served one; NotFound if unknown."""
        wanted = model_id or self._serving
        if wanted == self.configured.model_id:
            return self.configured
        opener = self._others.get(wanted)
        if opener is None:
            known = sorted({self.configured.model_id, *self._others})
            raise NotFound(f"model {wanted!r} is not available here; known: {', '.join(known)}")
        async with self._lock:
            if wanted not in self._loaded:
                stack = contextlib.AsyncExitStack()
                embedder = await stack.enter_async_context(opener())
                self._loaded[wanted] = (embedder, stack)
                log.info("loaded model %s beside %s", wanted, self.configured.model_id)
        return self._loaded[wanted][0]

    async def serve(self, model_id: str) -> Embedder:
        """Makes model_id the served model; other models not configured are let go (a finished
        re-embed frees the old one)."""
        embedder = await self.get(model_id)
        self._serving = embedder.model_id
        async with self._lock:
            for other in [m for m in self._loaded if m != self._serving]:
                _, stack = self._loaded.pop(other)
                await stack.aclose()
                log.info("unloaded model %s", other)
        return embedder

    async def aclose(self) -> None:
        """Stops every model loaded beside the configured one; closing twice is harmless."""
        async with self._lock:
            while self._loaded:
                _, (_, stack) = self._loaded.popitem()
                await stack.aclose()


def _other_onnx_models(config: EmbedderConfig) -> dict[str, Opener]:
    """The ONNX models this embedder can load besides its configured one: the packaged
    default and HYATLAS_PREVIOUS_MODEL_DIR's."""
    found: list[ModelFiles] = []
    finders: list[Callable[[], ModelFiles]] = [default_model_files]
    previous = config.previous_model_dir
    if previous is not None:
        finders.append(lambda: model_files_in(previous))
    for finder in finders:
        try:
            found.append(finder())
        except ConfigError as exc:
            log.info("no other model there: %s", exc)
    return {files.spec.model_id: functools.partial(opened_onnx, files, config) for files in found}


@contextlib.asynccontextmanager
async def opened_models(config: EmbedderConfig) -> AsyncIterator[ModelSet]:
    """The configured model, and (for ONNX) the others the embedder may be asked to run."""
    async with opened_embedder(config) as configured:
        others = (
            await asyncio.to_thread(_other_onnx_models, config)
            if config.backend == "onnx"
            else {}
        )
        models = ModelSet(configured, others)
        try:
            yield models
        finally:
            await models.aclose()
