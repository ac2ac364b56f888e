"""The embedder's domain: request limits, query prefixes, and the backend behind the batcher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from services.embedder.batcher import MicroBatcher
from services.embedder.config import EmbedderConfig
from services.embedder.hash_encoder import HASH_MODEL_ID, HashEncoder
from services.embedder.models import find_model_files
from services.embedder.onnx_encoder import OnnxEncoder
from services.embedder.remote_encoder import opened_remote_encoder
from shared.clients import MAX_TEXTS
from shared.errors import InvalidArgument
from shared.passages import Passage, row_texts

log = logging.getLogger(__name__)

MAX_TEXT_CHARS = 100_000


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


def check_passages(passages: Sequence[Passage]) -> None:
    """Refuses a request over the size limits or with a span outside its text, naming it."""
    if len(passages) > MAX_TEXTS:
        raise InvalidArgument(f"{len(passages)} texts in one request; at most {MAX_TEXTS}")
    spans = sum(len(p.spans) for p in passages)
    if spans > MAX_TEXTS:
        raise InvalidArgument(f"{spans} spans in one request; at most {MAX_TEXTS}")
    for index, passage in enumerate(passages):
        if len(passage.text) > MAX_TEXT_CHARS:
            raise InvalidArgument(
                f"texts[{index}] has {len(passage.text)} characters; at most {MAX_TEXT_CHARS}"
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
        return await self.embed_passages([Passage(text) for text in texts])

    async def embed_passages(self, passages: Sequence[Passage]) -> np.ndarray:
        """Unit float32 rows for each passage in order: its text's, then each span's."""
        check_passages(passages)
        if not passages:
            return np.zeros((0, self._info.ndim), dtype=np.float32)
        return await self._batcher.embed(passages)

    @property
    def model_id(self) -> str:
        """The id recorded next to every vector this embedder makes."""
        return self._info.model_id


def _batcher(
    run: Callable[[list[Passage]], Awaitable[np.ndarray]], config: EmbedderConfig
) -> MicroBatcher[Passage]:
    return MicroBatcher(
        run, config.max_batch, rows_of=lambda passage: passage.rows, max_queue=config.max_queue
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
            encoder = await asyncio.to_thread(
                OnnxEncoder, files, config.threads, config.pooled_spans
            )
            spec = encoder.spec
            info = ModelInfo(
                spec.model_id, spec.ndim, True, spec.pooling, spec.max_tokens, spec.query_prefix
            )

            async def run_onnx(passages: list[Passage]) -> np.ndarray:
                return await asyncio.to_thread(encoder.encode_passages, passages)

            batcher = await stack.enter_async_context(_batcher(run_onnx, config))
            yield Embedder(batcher, info)
