"""Opening the store: which model its vectors are of (and a re-embed to the configured one),
the indexes caught up and saved, on exit and periodically."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from services.store import reembed
from services.store.core import VectorModel
from services.store.disk_reserve import keep_reserve, release_if_full, upkeep
from services.store.index import DEFAULT_BUDGET_BYTES, VectorIndexes
from services.store.off_calendar import clear_off_calendar_dates
from services.store.reembed import ModelSource, ReembedPlan
from services.store.repo import Repo
from services.store.retrieval import EXACT_UP_TO
from services.store.snapshot import SnapshotPlan, clear_leftovers
from services.store.store import Store
from shared.errors import ConfigError, NotFound
from shared.runtime import background

log = logging.getLogger(__name__)

# Held (flock) by the one store running on a data folder, for as long as it runs.
LOCK_NAME = "store.lock"


async def _served(embedder: ModelSource, model_id: str) -> bool:
    """Asks the embedder to serve model_id (what searches embed with); False if it cannot."""
    try:
        await embedder.serve(model_id)
    except NotFound:
        return False
    return True


async def _vector_models(
    repo: Repo, embedder: ModelSource
) -> tuple[VectorModel, VectorModel | None]:
    """The model the store's vectors come from now, and the configured model a re-embed moves
    them to (None when they are of it). Searches keep the old model while the embedder can
    still run it, else they are refused until the re-embed is done."""
    served = await embedder.describe()
    configured = served
    if served.configured_model_id and served.configured_model_id != served.model_id:
        configured = await embedder.describe(served.configured_model_id)
    want = VectorModel(configured.model_id, configured.ndim)
    counts = await repo.vector_models()
    if not counts:
        await repo.set_meta("model_id", want.model_id)
        await repo.set_meta("ndim", str(want.ndim))
    built = await repo.get_meta("model_id") or max(counts, key=lambda m: counts[m])
    built_ndim = int(await repo.get_meta("ndim") or want.ndim)
    if len(counts) > 1:
        log.warning("the store holds vectors of several models: %s", counts)
    if built == want.model_id:
        await reembed.drop(repo)
        await _served(embedder, built)
        return want, None
    await reembed.begin(repo, want)
    if await _served(embedder, built):
        return VectorModel(built, built_ndim), want
    mismatch = (
        f"the store's vectors come from model {built!r}, which the embedder cannot run (set "
        f"HYATLAS_PREVIOUS_MODEL_DIR to its folder); searches and writes wait for the re-embed "
        f"to {want.model_id!r}"
    )
    return VectorModel(built, built_ndim, mismatch=mismatch), want


def check_writable(data_dir: Path) -> None:
    """A ConfigError unless the store can write in its data folder (made if missing): it
    keeps its database, indexes and lock there."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"the data folder {data_dir} cannot be made: {exc.strerror}") from exc
    if not os.access(data_dir, os.W_OK):
        raise ConfigError(
            f"the data folder {data_dir} is not writable (a read-only file system, or no write "
            "permission): the store keeps its database and indexes there"
        )


@contextlib.contextmanager
def held_data_folder(data_dir: Path) -> Iterator[None]:
    """Locks the data folder for this store until exit; a ConfigError when another store holds
    it (two would write one database and its indexes, and both re-embed into vectors.next)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise ConfigError(
                f"another store holds the data folder {data_dir} (it has {path} locked): "
                "stop it first, or give this store another HYATLAS_GO_DATA"
            ) from exc
        yield
    finally:
        os.close(fd)  # lets the lock go


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
    embedder: ModelSource,
    alias_group: Callable[[str], tuple[str, ...]],
    save_every_s: float | None = 30.0,
    exact_up_to: int = EXACT_UP_TO,
    index_budget_bytes: int = DEFAULT_BUDGET_BYTES,
    snapshot_plan: SnapshotPlan | None = None,
    reembed_plan: ReembedPlan | None = None,
    first_id: Callable[[str], str] = str,
) -> AsyncIterator[Store]:
    """Opens the database and the vector indexes (caching them up), saves them on exit, and
    re-embeds the store when the embedder's configured model is not the one it was built with."""
    async with contextlib.AsyncExitStack() as stack:
        stack.enter_context(held_data_folder(data_dir))
        # Only once the folder is this store's: another one's snapshot may be under way.
        if snapshot_plan is not None:
            await asyncio.to_thread(clear_leftovers, snapshot_plan.folder)
        await asyncio.to_thread(release_if_full, data_dir)
        repo = await stack.enter_async_context(Repo(data_dir / "hyatlas.db"))
        await clear_off_calendar_dates(repo)
        model, target = await _vector_models(repo, embedder)
        folder = data_dir / "vectors"
        await asyncio.to_thread(reembed.settle_index_folders, folder, model.model_id)
        if model.mismatch:
            log.error("%s", model.mismatch)
        indexes = VectorIndexes(
            folder,
            model.ndim,
            repo.vector_keys_of,
            lambda keys: repo.vectors_for_keys(keys, indexes.ndim),
            index_budget_bytes,
        )
        indexes.open()
        stack.push_async_callback(indexes.save)
        store = Store(
            repo, indexes, embedder, model, alias_group, data_dir, exact_up_to, snapshot_plan,
            first_id=first_id,
        )
        if save_every_s:
            background(stack, save_periodically(indexes, save_every_s), "index saver")
            background(stack, upkeep(data_dir, save_every_s), "disk reserve")
        if store.snapshots is not None and store.snapshots.plan.every_s:
            background(stack, store.snapshots.run_schedule(), "snapshots")
        if target is not None:
            job = store.start_reembed(embedder, folder, target, reembed_plan or ReembedPlan())
            background(stack, job.run(), "re-embed")
        await asyncio.to_thread(keep_reserve, data_dir)
        log.info(
            "store open at %s: model %s (%d-d)%s; indexes load on demand, up to %d MiB",
            data_dir, model.model_id, model.ndim,
            f", re-embedding to {target.model_id}" if target else "",
            index_budget_bytes >> 20,
        )
        yield store
