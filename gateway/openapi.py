"""The OpenAPI 3.1 document of every route, built from one short declaration per operation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.params import FREE_TEXT
from gateway.respond import json_response
from gateway.routes.status import VERSION
from shared.layers import LAYER_NAMES
from shared.limits import MAX_METADATA_BYTES, MAX_NAME_CHARS, MAX_TEXT_CHARS

Schema = dict[str, Any]

STR: Schema = {"type": "string"}
NAME: Schema = {"type": "string", "maxLength": MAX_NAME_CHARS}
TEXT: Schema = {"type": "string", "maxLength": MAX_TEXT_CHARS}
INT: Schema = {"type": "integer"}
NUM: Schema = {"type": "number"}
BOOL: Schema = {"type": "boolean"}
ANY_OBJ: Schema = {"type": "object"}
TIME: Schema = {
    "description": "unix seconds, or an RFC3339 / ISO date (1970-01-01 to 9999-12-31 UTC)",
    # The last two lie outside that range once their offset is applied (a 400).
    "examples": [1700000000, "2023-05-08", "2023-11-14T23:13:20+01:00",
                 "0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-23:59"],
    "oneOf": [
        {"type": "number", "minimum": 0, "exclusiveMaximum": 253402300800},
        {"type": "string", "format": "date-time"},
        {"type": "string", "format": "date"},
    ],
}
REFERENCE_TIME: Schema = {
    **TIME,
    "description": TIME["description"] + "; its UTC offset (whole minutes) sets the days the "
    "query's dates name, from midnight to midnight there (none, or Z: UTC days)",
}
EVENT_TIME: Schema = {
    **TIME,
    "description": TIME["description"] + "; when it was said: its UTC offset (whole minutes) is "
    "kept as the writer's, whose days extraction reads the turn in (none, or Z: UTC days)",
}
LAYER: Schema = {
    "type": "string", "maxLength": MAX_NAME_CHARS,
    "examples": ["*", *LAYER_NAMES.values()],
    "description": "a layer (l2_raw, L2, 2 or raw); empty or * is every layer",
}
METADATA: Schema = {
    "type": "object", "description": f"at most {MAX_METADATA_BYTES:,} bytes as JSON",
}


def arr(items: Schema, **extra: Any) -> Schema:
    """An array of items."""
    return {"type": "array", "items": items, **extra}


def obj(*required: str, **properties: Schema) -> Schema:
    """An object with these properties, the named ones required; other keys may appear."""
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


def nullable(schema: Schema) -> Schema:
    """The schema or null."""
    return {"oneOf": [schema, {"type": "null"}]}


ERROR = obj("error", error=STR)
OWNER = {"user_id": NAME, "agent_id": NAME}
LAYERS = obj(**{name: INT for name in LAYER_NAMES.values()})
MEMORY = obj(
    "memory_id", "content", "layer", "user_id", "agent_id", "session_id", "ts", "gmt_created",
    memory_id=STR, content=STR, layer=STR, user_id=STR, agent_id=STR, session_id=STR, ts=STR,
    gmt_created=INT, extracted=BOOL, extraction_status=STR, label=STR, count=INT, event_at=INT,
    utc_offset_minutes=INT, due_at=INT, invalid_at=STR, superseded_by=STR, superseded_how=STR,
    drop_reason=STR,
)
HIT = obj("memory_id", "content", "score", "layer", "gmt_created", "user_id", "agent_id",
          memory_id=STR, content=STR, score=NUM, layer=STR, gmt_created=INT, user_id=STR,
          agent_id=STR, event_at=INT, due_at=INT, utc_offset_minutes=INT, label=STR,
          replaced=arr(ANY_OBJ),
          evidence=arr(ANY_OBJ))
NODE = obj("id", "label", "type", id=STR, label=STR, type=STR)
LINK = obj("from", "to", "relation", **{"from": STR, "to": STR, "relation": STR, "weight": NUM})
EDGE = obj("id", "from", "to", "relation", id=STR, relation=STR, weight=NUM, sources=arr(STR),
           facts=arr(STR), recorded_at=INT, **{"from": STR, "to": STR})
JSON_LINES = arr(
    obj("type", type={"enum": ["memory", "edge", "gone", "end"]}, memory=ANY_OBJ, edge=ANY_OBJ,
        gone=ANY_OBJ, lines=INT),
    description="one JSON object a line (JSONL); the first may be an export's header, the last "
    'its end line ({"type": "end", "lines": N}, N the lines before it)',
)
GRAPH_QUERY = {**OWNER, "n": INT, "k_semantic": INT}


@dataclass(frozen=True)
class Op:
    """One operation: its parameters (a JSON body for POST/DELETE, the query string for GET) and
    what a success returns."""

    method: str
    path: str
    summary: str
    params: Mapping[str, Schema] = field(default_factory=dict)
    reply: Schema | None = None
    required: tuple[str, ...] = ()
    public: bool = False
    """Needs no token (liveness, readiness, the dashboard's shell)."""
    content: str = "application/json"
    """The media type of a success."""
    body_type: str = "application/json"
    """The media type of the request body."""
    query: Mapping[str, Schema] = field(default_factory=dict)
    """Query parameters of an operation whose body is not JSON."""
    extra_responses: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, Schema] = field(default_factory=dict)
    """Request headers the operation reads."""


def both(path: str, summary: str, params: Mapping[str, Schema], reply: Schema,
         required: tuple[str, ...] = ()) -> list[Op]:
    """A route that reads the same parameters from GET's query string or POST's body."""
    return [Op(method, path, summary, params, reply, required) for method in ("GET", "POST")]


DIGEST = obj("digest_ok", digest_ok=BOOL, runs=INT, last=nullable(ANY_OBJ), last_at=STR,
             running=BOOL, report=ANY_OBJ, graph_nodes=INT, graph_edges=INT, mode=STR, reason=STR)
UNDO = obj("undone", "pass_id", undone=BOOL, pass_id=STR, restored=arr(STR), retired=arr(STR),
           edges=arr(STR), kept=arr(STR), kept_why=ANY_OBJ)
DELETE_PARAMS = {"id": NAME, **OWNER, "layer": LAYER, "all": BOOL, "confirm": NAME, "origin": NAME}
READY = obj("status", "ready", "services", status=STR, ready=BOOL, services=ANY_OBJ)

OPERATIONS: list[Op] = [
    Op("GET", "/healthz", "Liveness", reply=obj("status", status=STR), public=True),
    Op("GET", "/readyz", "Readiness of every backing service the mode needs", reply=READY,
       public=True, extra_responses={"503": {"description": "not ready yet", "content": {
           "application/json": {"schema": READY}}}}),
    Op("GET", "/metrics", "Prometheus metrics of the gateway and every service",
       content="text/plain"),
    Op("GET", "/api/v1/openapi.json", "This document", reply=obj("openapi", "paths")),
    Op("GET", "/api/v1/status", "Mode, model, services, counts",
       reply=obj("status", "mode", "layers", status=STR, ready=BOOL, services=ANY_OBJ,
                 version=STR, mode=STR, llm=STR, layers=LAYERS, writes=INT, searches=INT,
                 embed=STR, embed_problem=STR, scopes=arr(STR), reaches_every_owner=BOOL)),
    Op("GET", "/api/v1/metrics", "Live rows per layer and the graph's size",
       reply=obj("layers", "total", layers=LAYERS, total=INT, graph_nodes=INT, graph_edges=INT)),
    Op("GET", "/api/v1/owners", "Users and agents with row counts", {"user_id": NAME},
       obj("users", users=arr(obj("user_id", "agents", user_id=STR, live=INT, retired=INT,
                                  last_write_at=STR, agents=arr(ANY_OBJ))))),
    Op("POST", "/api/v1/add", "Stores one raw turn",
       {"text": TEXT, "data": TEXT, **OWNER, "session_id": NAME, "metadata": METADATA,
        "event_at": EVENT_TIME},
       obj("success", "memory_id", "extraction_status", success=BOOL, memory_id=STR,
           extraction_status=STR, replayed=BOOL),
       headers={"Idempotency-Key": {"type": "string", "maxLength": 255}}),
    *both("/api/v1/list", "One owner's rows, newest first",
          {"layer": LAYER, **OWNER, "limit": INT, "offset": INT, "before": NAME,
           "include_raw": BOOL, "include_superseded": BOOL, "contains": NAME},
          obj("total", "offset", "limit", "memories", "layers", "next_before", total=INT,
              offset=INT, limit=INT, memories=arr(MEMORY), layers=LAYERS, graph_nodes=INT,
              graph_edges=INT, next_before=STR)),
    *(Op(method, "/api/v1/delete_all", "Deletes one row by id, or (admin) rows in a scope",
         DELETE_PARAMS, obj("deleted_count", deleted_count=INT, error=STR))
      for method in ("POST", "DELETE")),
    Op("POST", "/api/v1/restore", "Brings a retired row back",
       {"id": NAME, "memory_id": NAME, **OWNER, "origin": NAME, "reason": TEXT},
       obj("restored", "memory", restored=BOOL, memory=MEMORY)),
    Op("POST", "/api/v1/update", "Stores new text as a new version of a row",
       {"id": NAME, "memory_id": NAME, "text": TEXT, "event_at": EVENT_TIME, **OWNER,
        "origin": NAME, "reason": TEXT},
       obj("success", "memory_id", "replaced", "changed", success=BOOL, memory_id=STR,
           replaced=STR, changed=BOOL, extraction_status=STR)),
    *both("/api/v1/history", "A row's audit trail", {"id": NAME, "memory_id": NAME, **OWNER},
          obj("memory_id", "history", memory_id=STR, history=arr(obj(
              "seq", "at", "actor", "action", seq=INT, at=STR, actor=STR, action=STR,
              reason=STR, before=nullable(ANY_OBJ), after=nullable(ANY_OBJ))))),
    Op("POST", "/api/v1/flush", "Persists the vector indexes; keyword indexes catch up",
       reply=obj("flushed", flushed=BOOL, vectors=INT)),
    *both("/api/v1/search", "Ranked memories of one owner in channels",
          {"query": TEXT, "limit": INT, "layer": LAYER, **OWNER, "user_ids": arr(NAME),
           "agent_ids": arr(NAME), "min_score": {"type": "number", "minimum": 0, "maximum": 1},
           "reader": NAME, "session_id": NAME, "reference_time": REFERENCE_TIME,
           "skip_stages": arr(NAME)},
          obj("memories", "order", memories={"type": "object", "additionalProperties": arr(HIT)},
              order=arr(STR), now=HIT),
          required=("query",)),
    Op("POST", "/api/v1/feedback", "Reports which recalled memories a reply used",
       {"memory_ids": arr(NAME, maxItems=100), "ids": arr(NAME, maxItems=100), **OWNER},
       obj("success", "recorded", success=BOOL, recorded=INT, usage_learning=BOOL)),
    Op("POST", "/api/v1/reprocess", "Re-extracts raw rows", {"ids": arr(NAME), "max": INT},
       obj("reprocessed", "failed", "skipped", reprocessed=INT, failed=INT, skipped=INT,
           note=STR)),
    Op("POST", "/api/v1/llm/key", "Hands an LLM key to the extractor (loopback only)",
       {"key": TEXT, "llm_key": TEXT}, obj("ok", ok=BOOL, llm=STR)),
    Op("POST", "/api/v1/forget", "Retires the rows holding a value and tombstones it",
       {"text": TEXT, "old_text": TEXT, "id": NAME, "memory_id": NAME, **OWNER,
        "reason": TEXT, "origin": NAME, "source": NAME, "metadata": METADATA, "target": NAME},
       obj("forgotten", "memories", forgotten=INT, memories=arr(MEMORY),
           evidence_ids=arr(STR))),
    *both("/api/v1/digest", "GET: the last consolidation pass; POST: runs one now", {}, DIGEST),
    Op("POST", "/api/v1/digest/undo", "Reverts a consolidation pass", {"pass_id": NAME}, UNDO,
       ("pass_id",)),
    Op("POST", "/api/v1/undo_pass", "Reverts a consolidation pass (older name)",
       {"pass_id": NAME}, UNDO, ("pass_id",)),
    *both("/api/v1/graph", "One node's neighbours and the graph's size", {"node": TEXT, **OWNER},
          obj("node", "neighbors", "node_count", "edge_count", node=STR,
              neighbors=arr(obj("label", "relation", "incoming", label=STR, relation=STR,
                                incoming=BOOL)),
              node_count=INT, edge_count=INT, extract_err=STR)),
    Op("GET", "/api/v1/graph-as-of", "The graph as it stood at ts",
       {"ts": TIME, "n": INT, **OWNER},
       obj("nodes", "relations", "as_of", "total", nodes=arr(NODE), relations=arr(EDGE),
           as_of=INT, total=INT)),
    Op("GET", "/api/v1/edges", "Relations and links between memories", GRAPH_QUERY,
       obj("nodes", "knowledge", "co_session", "semantic", "total_edges", "total_memories",
           nodes=arr(NODE), knowledge=arr(EDGE), co_session=arr(LINK), semantic=arr(LINK),
           total_edges=INT, total_memories=INT)),
    Op("GET", "/api/v1/learning/graph", "The starmap feed", GRAPH_QUERY,
       obj("nodes", "edges", "memory", "stats", nodes=arr(NODE), edges=arr(EDGE),
           memory=ANY_OBJ, stats=ANY_OBJ)),
    Op("POST", "/api/v1/admin/compact_raw", "Caps raw turns (admin; dry run by default)",
       {"dry_run": BOOL},
       obj("dry_run", "rows_checked", "rows_changed", dry_run=BOOL, rows_checked=INT,
           rows_changed=INT, bytes_before=INT, bytes_after=INT, sample=arr(STR),
           rows_rewritten=INT)),
    Op("POST", "/api/v1/admin/dedupe_facts", "Supersedes near-duplicate facts (admin)",
       {"dry_run": BOOL, "threshold": {"type": "number", "minimum": 0, "maximum": 1}},
       obj("dry_run", "duplicates", dry_run=BOOL, threshold=NUM, owners=INT, facts=INT,
           duplicates=INT, sample=arr(STR), rows_superseded=INT)),
    Op("POST", "/api/v1/admin/snapshot", "A snapshot of the data directory now (admin)",
       reply=obj("path", "bytes", "paused_s", path=STR, bytes=INT, paused_s=NUM)),
    Op("GET", "/api/v1/export", "The scope's rows and edges as JSONL (gone: and the ids of "
       "rows deleted for good and edges undone)", {**OWNER, "gone": BOOL},
       content="application/x-ndjson"),
    Op("POST", "/api/v1/import", "Writes an export (or minimal memory lines), streamed (sync: "
       "replaces rows and edges that differ, applies gone lines)",
       reply=obj("lines", "imported", "skipped", "refused", "errors", "stopped", lines=INT,
                 imported=INT, skipped=INT, updated=INT, erased=INT, refused=INT,
                 errors=arr(obj("line", "error", line=INT, error=STR)), stopped=BOOL,
                 error=STR, complete=BOOL),
       body_type="application/x-ndjson", query={**OWNER, "sync": BOOL}),
    Op("GET", "/dashboard", "Redirects to /dashboard/", public=True, content="",
       extra_responses={"302": {"description": "to /dashboard/"}}),
    Op("GET", "/dashboard/", "The dashboard's page", public=True, content="text/html"),
    Op("GET", "/dashboard/{tail}", "A file of the dashboard", public=True, content="*/*"),
    Op("GET", "/dashboard/api/memory", "One row with its sources and replacements",
       {"id": NAME, **OWNER},
       obj("memory", "sources", "replaced", memory=ANY_OBJ, sources=arr(ANY_OBJ),
           missing_sources=arr(STR), replaced_by=nullable(ANY_OBJ), replaced=arr(ANY_OBJ)),
       ("id",)),
    Op("GET", "/dashboard/api/writes", "Rows an owner gained per day",
       {**OWNER, "days": INT},
       obj("days", user_id=STR, agent_id=STR,
           days=arr(obj("date", "raw", "derived", date=STR, raw=INT, derived=INT)))),
    Op("GET", "/dashboard/api/system", "Service health, settings, data size, snapshots",
       reply=obj("services", "settings", services=arr(ANY_OBJ), settings=ANY_OBJ, data_dir=STR,
                 data_bytes=INT, snapshots=ANY_OBJ, store_backend=STR, now=STR)),
    Op("GET", "/dashboard/api/search-stages", "The ranking stages skip_stages may name",
       reply=obj("stages", stages=arr(STR))),
]


ERROR_DESCRIPTION = (
    "a JSON error: 4xx for the request, 5xx for the server; a request line or header over "
    "8,190 bytes is a plain-text 400 from the HTTP parser, before any route runs"
)


def _parameter(name: str, schema: Schema, where: str, required: bool) -> Schema:
    return {"name": name, "in": where, "required": required, "schema": schema}


def _responses(op: Op) -> dict[str, Any]:
    success: dict[str, Any] = {"description": "success"}
    if op.content:
        success["content"] = {op.content: {"schema": op.reply or STR}}
    error = {"description": ERROR_DESCRIPTION,
             "content": {"application/json": {"schema": ERROR}, "text/plain": {"schema": STR}}}
    return {"200": success, **op.extra_responses, "default": error}


def operation(op: Op) -> dict[str, Any]:
    """The OpenAPI operation object of one declaration."""
    spec: dict[str, Any] = {"summary": op.summary, "responses": _responses(op)}
    parameters = [_parameter(name, schema, "query", False) for name, schema in op.query.items()]
    parameters += [_parameter(name, schema, "header", False) for name, schema in op.headers.items()]
    if "{tail}" in op.path:
        parameters.append(_parameter("tail", STR, "path", True))
    if op.method == "GET":
        parameters += [_parameter(name, schema, "query", name in op.required)
                       for name, schema in op.params.items()]
    elif op.body_type != "application/json":
        spec["requestBody"] = {"content": {op.body_type: {"schema": JSON_LINES}}}
    elif op.params:
        body = obj(*op.required, **op.params)
        spec["requestBody"] = {"content": {"application/json": {"schema": body}}}
    if parameters:
        spec["parameters"] = parameters
    if op.public:
        spec["security"] = []
    return spec


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route."""
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method.lower()] = operation(op)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "HyAtlas Memory",
            "version": VERSION,
            "description": (
                f"Limits: free text ({', '.join(sorted(FREE_TEXT))}) up to {MAX_TEXT_CHARS:,} "
                f"characters (413 past it); every other string up to {MAX_NAME_CHARS} (400); "
                f"metadata up to {MAX_METADATA_BYTES:,} bytes as JSON (413)."
            ),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }


routes = web.RouteTableDef()


@routes.get("/api/v1/openapi.json")
async def openapi_json(request: web.Request) -> web.Response:
    """The OpenAPI 3.1 document of this API."""
    return json_response(document())
