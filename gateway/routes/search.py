"""Search and the feedback that ranks used memories a little higher."""

from __future__ import annotations

from aiohttp import web

from gateway.params import Params
from gateway.respond import (
    INT32_MIN,
    json_response,
    layer_filter,
    owner_scope,
    request_params,
    rpc_timeout,
    writes,
)
from gateway.shapes import search_response
from gateway.state import CONFIG, COUNTERS, SEARCH, STORE
from shared.errors import InvalidArgument
from shared.pb import search_pb2, store_pb2

# The reference reads every reader it does not know as hybrid; hybrid_v2 is one it once had.
READER_ALIASES = {"hybrid_v2": "hybrid"}
MAX_FEEDBACK_IDS = 100

routes = web.RouteTableDef()


def _reader(text: str) -> str:
    """The reader name for the search service, which validates it (unknown names are a 400)."""
    key = text.lower()
    return READER_ALIASES.get(key, key)


def _one_named(params: Params, one: str, many: str) -> str:
    """The one owner name a search gives as `one` or in the list `many` ("" for none)."""
    named = [name for name in dict.fromkeys([params.string(one), *params.strings(many)]) if name]
    if len(named) > 1:  # never searched for only the first: that would drop the others unsaid
        raise InvalidArgument(
            f"a search covers one {one.removesuffix('_id')} ({len(named)} named in {one} and "
            f"{many}): search each"
            + (", or make them one owner with HYATLAS_USER_ALIASES" if one == "user_id" else "")
        )
    return named[0] if named else ""


@routes.get("/api/v1/search")
@routes.post("/api/v1/search")
async def search(request: web.Request) -> web.Response:
    """Ranked memories of one owner in the reference's channels."""
    params = await request_params(request)
    query = params.string("query")
    if not query:
        raise InvalidArgument("query required")
    # The search service sets the default for 0 and refuses a negative limit or one over its
    # maximum (400), never cuts it.
    limit = params.integer("limit", 0, lo=INT32_MIN)
    layer = params.string("layer")
    user_id = _one_named(params, "user_id", "user_ids")
    agent_id = _one_named(params, "agent_id", "agent_ids")
    min_score = params.number("min_score", lo=0.0, hi=1.0)
    reference = params.time_and_offset("reference_time")

    req = search_pb2.SearchMemoriesRequest(
        scope=owner_scope(user_id, agent_id),
        query=query,
        limit=limit,
        layers=layer_filter(layer),
        reader=_reader(params.string("reader")),
        session_id=params.string("session_id"),
        # A debugging option: ranking stages to switch off for this one search.
        skip_stages=params.strings("skip_stages"),
    )
    if min_score is not None:
        req.min_score = min_score
    if reference is not None:
        req.reference_time = reference[0]
        req.reference_utc_offset_minutes = reference[1] or 0
    reply = await request.app[SEARCH].SearchMemories(req, timeout=rpc_timeout(request))
    request.app[COUNTERS].searches += 1
    return json_response(search_response(reply))


@routes.post("/api/v1/feedback")
@writes
async def feedback(request: web.Request) -> web.Response:
    """A client reports which recalled memories a reply used; search ranks them a little higher.

    Each id must be one of the owner's rows (else 404, nothing counted). With
    HYATLAS_USAGE_LEARNING off nothing is recorded.
    """
    params = await request_params(request)
    memory_ids = list(dict.fromkeys(params.strings("memory_ids") or params.strings("ids")))
    if not memory_ids:
        raise InvalidArgument("memory_ids required")
    if len(memory_ids) > MAX_FEEDBACK_IDS:
        raise InvalidArgument(f"at most {MAX_FEEDBACK_IDS} memory_ids per call")
    if not request.app[CONFIG].usage_learning:
        return json_response({"success": True, "recorded": 0, "usage_learning": False})
    scope = owner_scope(params.string("user_id"), params.string("agent_id"))
    # One transaction that adds to hits: concurrent feedback never loses a count, and an id
    # outside the owner's rows refuses the whole call (404, nothing counted).
    ops = [
        store_pb2.Op(update=store_pb2.UpdateOp(id=memory_id, hits_delta=1))
        for memory_id in memory_ids
    ]
    await request.app[STORE].Apply(
        store_pb2.ApplyRequest(scope=scope, ops=ops, actor="api", reason="feedback"),
        timeout=rpc_timeout(request),
    )
    return json_response({"success": True, "recorded": len(ops), "usage_learning": True})
