"""Opening the store: the model check, the indexes caught up and saved, on exit and periodically."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from services.store.core import Embedder, VectorModel
from services.store.index import DEFAULT_BUDGET_BYTES, VectorIndexes
from services.store.repo import Repo
from services.store.retrieval import EXACT_UP_TO
from services.store.snapshot import SnapshotPlan
from services.store.store import Store
from shared.runtime import background

log = logging.getLogger(__name__)


async def _vector_model(repo: Repo, model_id: str, ndim: int) -> VectorModel:
    """Which model the store is built with; a mismatch with the embedder's refuses searches."""
    counts = await repo.vector_models()
    if not counts:
        await repo.set_meta("model_id", model_id)
        await repo.set_meta("ndim", str(ndim))
        return VectorModel(model_id, ndim)
    built = await repo.get_meta("model_id") or max(counts, key=lambda m: counts[m])
    built_ndim = int(await repo.get_meta("ndim") or ndim)
    if len(counts) > 1:
        log.warning("the store holds vectors of several models: %s", counts)
    if built != model_id:
        # TODO: a re-embed command that moves the store over to the embedder's model.
        return VectorModel(
            built,
            built_ndim,
            mismatch=(
                f"the store was built with model {built!r} but the embedder runs "
                f"{model_id!r}; re-embed the store before searching or writing it"
            ),
        )
    return VectorModel(model_id, ndim)


async def save_periodically(indexes: VectorIndexes, every_s: float) -> None:
    """Saves changed indexes every every_s seconds, until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        if indexes.dirty:
            try:
                count = await indexes.save()
            except Exception:
                log.exception("saving the vector indexes failed; will retry")
            else:
                log.info("saved vector indexes (%d vectors)", count)


@contextlib.asynccontextmanager
async def open_store(
    data_dir: Path,
    embedder: Embedder,
    model_id: str,
    ndim: int,
    alias_group: Callable[[str], tuple[str, ...]],
    save_every_s: float | None = 30.0,
    exact_up_to: int = EXACT_UP_TO,
    index_budget_bytes: int = DEFAULT_BUDGET_BYTES,
    snapshot_plan: SnapshotPlan | None = None,
) -> AsyncIterator[Store]:
    """Opens the database and the vector indexes (catching them up), and saves them on exit."""
    async with contextlib.AsyncExitStack() as stack:
        repo = await stack.enter_async_context(Repo(data_dir / "hyatlas.db"))
        model = await _vector_model(repo, model_id, ndim)
        indexes: VectorIndexes | None = None
        if model.mismatch:
            log.error("%s", model.mismatch)
        else:
            indexes = VectorIndexes(
                data_dir / "vectors",
                model.ndim,
                repo.vector_keys_of,
                lambda keys: repo.vectors_for_keys(keys, model.ndim),
                index_budget_bytes,
            )
            indexes.open()
            stack.push_async_callback(indexes.save)
        store = Store(
            repo, indexes, embedder, model, alias_group, data_dir, exact_up_to, snapshot_plan
        )
        if save_every_s and indexes is not None:
            background(stack, save_periodically(indexes, save_every_s), "index saver")
        if store.snapshots is not None and store.snapshots.plan.every_s:
            background(stack, store.snapshots.run_schedule(), "snapshots")
        log.info(
            "store open at %s: model %s (%d-d); indexes load on demand, up to %d MiB",
            data_dir, model.model_id, model.ndim, index_budget_bytes >> 20,
        )
        yield store
