"""Opening the store on PostgreSQL: the pool, the schema, which model the vectors are of."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from services.store.core import VectorModel
from services.store.off_calendar import clear_off_calendar_dates
from services.store.pg.db import Database
from services.store.pg.repo import PgRepo
from services.store.pg.schema import REEMBED_INSTEAD
from services.store.pg.vectors import PgVectors
from services.store.reembed import ModelSource
from services.store.retrieval import EXACT_UP_TO
from services.store.store import Store
from shared.redact import redact_url

log = logging.getLogger(__name__)


async def _model(repo: PgRepo, embedder: ModelSource) -> VectorModel:
    """The embedder's configured model; refused for searches and writes when the database's
    vectors come from another one (no re-embed on this backend yet)."""
    served = await embedder.describe()
    if served.configured_model_id and served.configured_model_id != served.model_id:
        served = await embedder.describe(served.configured_model_id)
    model = VectorModel(served.model_id, served.ndim)
    built = await repo.get_meta("model_id")
    if built is None:
        await repo.set_meta("model_id", model.model_id)
        await repo.set_meta("ndim", str(model.ndim))
        return model
    if built != model.model_id:
        mismatch = (
            f"the database's vectors come from model {built!r} but the embedder runs "
            f"{model.model_id!r}; a re-embed is not built for the PostgreSQL store yet: "
            f"{REEMBED_INSTEAD}"
        )
        log.error("%s", mismatch)
        return VectorModel(built, model.ndim, mismatch=mismatch)
    await embedder.serve(model.model_id)
    return model


@contextlib.asynccontextmanager
async def open_pg_store(
    dsn: str,
    data_dir: Path,
    embedder: ModelSource,
    alias_group: Callable[[str], tuple[str, ...]],
    exact_up_to: int = EXACT_UP_TO,
    first_id: Callable[[str], str] = str,
) -> AsyncIterator[Store]:
    """The store over the database at dsn (created or checked at open)."""
    served = await embedder.describe()
    db = await Database(dsn).open(served.ndim)
    repo = PgRepo(db)
    try:
        await clear_off_calendar_dates(repo)
        model = await _model(repo, embedder)
        store = Store(
            repo, PgVectors(db), embedder, model, alias_group, data_dir, exact_up_to,
            location=redact_url(dsn), first_id=first_id,
        )
        log.info("store open on %s: model %s (%d-d)", redact_url(dsn), model.model_id, model.ndim)
        yield store
    finally:
        await repo.close()
        await db.close()
