"""The plugin's Memory tab in Hermes's own dashboard, in headless Chromium, against a real stack."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web
from playwright.async_api import Browser, Page

from tests.support import Stack, free_port, http_ok, running_stack, serving_http
from tests.test_dashboard import CHROMIUM, browser
from tests.test_plugin_hermes import (
    GATEWAY_STATUS,
    gateway,
    hermes_env,
    hermes_python,
    make_home,
)

pytestmark = pytest.mark.slow

__all__ = ["browser", "hermes_python"]  # fixtures this module's tests use

SERVE = ("import sys, uvicorn; from hermes_cli import web_server; "
         "uvicorn.run(web_server.app, host='127.0.0.1', port=int(sys.argv[1]), "
         "log_level='warning')")
START_S = 120.0

if not os.path.exists(CHROMIUM):
    pytest.skip("Debian's chromium is not installed: run `make browser`", allow_module_level=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, embedder_address: str) -> Iterator[Stack]:
    """store + gateway in lite mode, shared by this module (each test has its own user)."""
    with running_stack(tmp_path_factory.mktemp("plugin-dashboard"), ["store", "gateway"],
                       HYATLAS_EMBEDDER_ADDR=embedder_address, HYATLAS_MODE="lite") as s:
        yield s


@contextlib.contextmanager
def hermes_dashboard(hermes_python: Path, home: Path) -> Iterator[str]:
    """Hermes's web server (its dashboard and the plugin's tab) on a free port; its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "dashboard.log"
    with log.open("wb") as out:
        # Run from the Hermes home: from this checkout, its `gateway` package would shadow
        # Hermes's own (python -c puts the working directory first on sys.path).
        proc = subprocess.Popen([str(hermes_python), "-c", SERVE, str(port)], cwd=home,
                                env=hermes_env(home), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_S
        while not http_ok(url + "/"):
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "Hermes's dashboard did not start"
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.asynccontextmanager
async def recent_tab(
    tmp_path: Path, hermes_python: Path, stack: Stack, browser: Browser, user: str, note: str
) -> AsyncIterator[Page]:
    """The plugin's tab for a user with 45 notes ("<note> 0" .. "<note> 44"), the first page
    of its Recent shown."""
    for i in range(45):
        gateway(stack, "POST", "/api/v1/add", {"text": f"{note} {i}", "user_id": user})
    home = make_home(tmp_path, hermes_python, server_url=stack.base_url, user_id=user)
    with hermes_dashboard(hermes_python, home) as url:
        page = await browser.new_page()
        await page.goto(url + "/hyatlas")
        await page.locator(".hyatlas-count").get_by_text("Showing 30 of 45 memories").wait_for()
        try:
            yield page
        finally:
            await page.close()


async def test_recent_says_how_many_memories_it_shows_of_all_and_pages_to_the_rest(
    tmp_path: Path, hermes_python: Path, stack: Stack, browser: Browser
) -> None:
    async with recent_tab(tmp_path, hermes_python, stack, browser, "u-recent-tab",
                          "Recent note number") as page:
        count = page.locator(".hyatlas-count")
        rows = page.locator(".hyatlas-count + ul > li.hyatlas-row")
        assert await rows.count() == 30
        assert "Recent note number 44" in await rows.first.inner_text()
        await page.get_by_role("button", name="Show 30 more").click()
        await count.get_by_text("Showing 45 of 45 memories").wait_for()
        assert await rows.count() == 45
        assert "Recent note number 0" in await rows.last.inner_text()
        assert await page.get_by_role("button", name="Show 30 more").count() == 0


async def test_recent_pages_by_the_cursor_so_rows_retired_between_pages_hide_none(
    tmp_path: Path, hermes_python: Path, stack: Stack, browser: Browser
) -> None:
    user = "u-recent-cursor"
    async with recent_tab(tmp_path, hermes_python, stack, browser, user,
                          "Cursor note number") as page:
        # Five rows of the first page are deleted before the next is asked for: by offset, the
        # next page started 30 rows into the 40 left and skipped the five that moved up.
        newest = gateway(stack, "POST", "/api/v1/list", {"user_id": user, "limit": 5})
        for memory in newest["memories"]:
            gateway(stack, "POST", "/api/v1/delete_all",
                    {"id": memory["memory_id"], "user_id": user})
        await page.get_by_role("button", name="Show 30 more").click()
        rows = page.locator(".hyatlas-count + ul > li.hyatlas-row")
        await rows.nth(44).wait_for()
        shown = {text.rsplit(" ", 1)[-1] for text in await rows.all_inner_texts()}
        assert shown == {str(i) for i in range(45)}
        # 45 shown, 40 live now: never "45 of 40".
        await page.locator(".hyatlas-count").get_by_text(
            "Showing 45 memories, newest first; 40 are live now").wait_for()
        assert await page.get_by_role("button", name="Show 30 more").count() == 0


async def test_the_tab_names_its_owner_counts_the_owners_rows_and_search_shows_the_now_page(
    tmp_path: Path, hermes_python: Path, browser: Browser
) -> None:
    """The status says whose memories the tab shows and how many that owner has live (not the
    server's writes since its start, shown apart as such); a search shows the Now page the
    agent's recall gets."""
    listed: list[dict[str, str]] = []

    async def status(request: web.Request) -> web.Response:
        return web.json_response({**GATEWAY_STATUS, "llm": "unused", "writes": 4,
                                  "layers": {"l2_raw": 500}})

    async def list_rows(request: web.Request) -> web.Response:
        listed.append(await request.json())
        return web.json_response({"total": 12, "memories": [], "next_before": "",
                                  "layers": {"l2_raw": 9, "l3_fact": 3}})

    async def search(request: web.Request) -> web.Response:
        hit = {"memory_id": "m1", "content": "Rui lives in Lisbon", "layer": "l3_fact",
               "score": 0.9, "gmt_created": 1764547200}
        now = {"memory_id": "p1", "content": "NOW: Rui moves to Lisbon on Friday",
               "layer": "l4_summary", "score": 1.0, "gmt_created": 1764547200}
        return web.json_response({"memories": {"normal": [hit]}, "order": ["now", "normal"],
                                  "now": now})

    app = web.Application()
    app.router.add_get("/api/v1/status", status)
    app.router.add_post("/api/v1/list", list_rows)
    app.router.add_post("/api/v1/search", search)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url, user_id="u-owner-tab",
                         agent_id="a-writer")
        with hermes_dashboard(hermes_python, home) as dashboard:
            page = await browser.new_page()
            try:
                await page.goto(dashboard + "/hyatlas")
                await page.locator(".hyatlas-owner").get_by_text(
                    "Memories of user u-owner-tab, every agent (this Hermes writes as agent "
                    "a-writer): 12 live").wait_for()
                server = await page.locator(".hyatlas-server").inner_text()
                await page.get_by_placeholder("Search memories").fill("where does Rui live")
                await page.get_by_role("button", name="Search").click()
                await page.locator(".hyatlas-now").get_by_text(
                    "NOW: Rui moves to Lisbon on Friday").wait_for()
            finally:
                await page.close()
    assert "4 writes since the server started" in server
    assert listed and all(body["user_id"] == "u-owner-tab" for body in listed)


async def test_recent_dates_a_memory_on_its_writers_day_and_a_date_alone_as_that_date(
    tmp_path: Path, hermes_python: Path, browser: Browser
) -> None:
    """A row's day is its writer's, at its utc_offset_minutes: 20:00 in Los Angeles on 28
    November is the 28th (the 29th in UTC), 05:00 on the 29th in Tokyo the 29th; a date kept
    alone at its UTC midnight is that date; a row from a server that sends no offset keeps its
    UTC day."""
    evening = 1795924800  # 2026-11-28T20:00-08:00, 04:00 UTC on the 29th
    rows = [
        {"memory_id": "m1", "content": "Kayak in Los Angeles", "layer": "l2_raw",
         "event_at": evening, "gmt_created": evening, "utc_offset_minutes": -480},
        {"memory_id": "m2", "content": "Hike in Sintra", "layer": "l3_fact",
         "event_at": 1795824000, "gmt_created": evening, "utc_offset_minutes": -480},
        {"memory_id": "m3", "content": "Sushi in Tokyo", "layer": "l2_raw",
         "gmt_created": 1795896000, "utc_offset_minutes": 540},
        {"memory_id": "m4", "content": "From an older server", "layer": "l2_raw",
         "event_at": evening, "gmt_created": evening},
        # Before 1970: until 2026-12-08 the tab showed the day it was recorded instead.
        {"memory_id": "m5", "content": "Born in Porto", "layer": "l3_fact",
         "event_at": -157766400, "gmt_created": evening, "utc_offset_minutes": -480},
    ]

    async def status(request: web.Request) -> web.Response:
        return web.json_response({**GATEWAY_STATUS, "llm": "unused"})

    async def list_rows(request: web.Request) -> web.Response:
        return web.json_response({"total": len(rows), "memories": rows, "next_before": "",
                                  "layers": {"l2_raw": 3, "l3_fact": 2}})

    app = web.Application()
    app.router.add_get("/api/v1/status", status)
    app.router.add_post("/api/v1/list", list_rows)
    async with serving_http(app) as url:
        home = make_home(tmp_path, hermes_python, server_url=url, user_id="u-days-tab")
        with hermes_dashboard(hermes_python, home) as dashboard:
            page = await browser.new_page()
            try:
                await page.goto(dashboard + "/hyatlas")
                await page.locator(".hyatlas-count").get_by_text(
                    "Showing 5 of 5 memories").wait_for()
                shown = page.locator(".hyatlas-count + ul > li.hyatlas-row")
                days = {await row.locator("span").last.inner_text():
                        await row.locator("code").inner_text() for row in await shown.all()}
            finally:
                await page.close()
    assert days == {"Kayak in Los Angeles": "2026-11-28", "Hike in Sintra": "2026-11-28",
                    "Sushi in Tokyo": "2026-11-29", "From an older server": "2026-11-29",
                    "Born in Porto": "1965-01-01"}
