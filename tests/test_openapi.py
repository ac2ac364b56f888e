"""The OpenAPI document: every route documented, nothing else, served behind the token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from schemathesis.openapi import from_dict

from gateway.app import make_app
from gateway.config import GatewayConfig
from gateway.openapi import document
from shared.settings import Settings
from tests.support import Stack, running_stack

TOKEN = "openapi-token"
ANY_METHOD = "*"


def _registered() -> dict[str, set[str]]:
    """The app's routes: path template -> methods (HEAD, which aiohttp adds to GET, left out)."""
    settings = Settings.from_env({})
    app = make_app(GatewayConfig.from_settings(settings), settings)
    routes: dict[str, set[str]] = {}
    for route in app.router.routes():
        assert route.resource is not None
        if route.method != "HEAD":
            routes.setdefault(route.resource.canonical, set()).add(route.method)
    return routes


def _documented() -> dict[str, set[str]]:
    return {path: {m.upper() for m in item} for path, item in document()["paths"].items()}


def test_every_route_is_documented_and_nothing_else() -> None:
    registered, documented = _registered(), _documented()
    assert set(registered) - set(documented) == set(), "routes missing from the document"
    assert set(documented) - set(registered) == set(), "documented paths no route serves"


def test_documented_methods_are_the_routes_methods() -> None:
    registered, documented = _registered(), _documented()
    for path, methods in registered.items():
        if methods == {ANY_METHOD}:
            # A route taking any method documents the ones its handler serves (others get 405
            # or the same answer as GET).
            assert documented[path], path
            assert documented[path] <= {"GET", "POST", "DELETE"}, path
        else:
            assert documented[path] == methods, path


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = document()
    assert doc["openapi"].startswith("3.1")
    schema = from_dict(doc)
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    assert sum(1 for result in schema.get_all_operations() if result.ok()) == sum(
        len(item) for item in doc["paths"].values()
    )
    assert list(schema.iter_schema_warnings()) == []


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    data_dir: Path = tmp_path_factory.mktemp("openapi")
    with running_stack(
        data_dir, ["store", "gateway"],
        HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_MODE="lite", HYATLAS_TOKEN=TOKEN,
    ) as running:
        yield running


@pytest.mark.slow
async def test_the_document_is_served_behind_the_token(stack: Stack) -> None:
    url = stack.base_url + "/api/v1/openapi.json"
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as reply:
            assert reply.status == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with session.get(url, headers=auth) as reply:
            assert reply.status == 200
            assert await reply.json() == document()
