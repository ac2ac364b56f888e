"""A scripted chat-completions server: replays answers and records every request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support import WAIT_CEILING_S

# An answer is the assistant's text, a dict (sent as JSON text), a function of the Recorded
# request returning one of those, or one of these actions.
HANG = "__hang__"  # never answers (the caller's timeout fires)
ERROR = "__error__"  # HTTP 500
REJECT_FORMAT = "__reject_format__"  # HTTP 400 naming response_format


def delayed(seconds: float, answer: Any) -> tuple[str, float, Any]:
    """An answer sent only after seconds."""
    return ("__delay__", seconds, answer)


def held(gate: threading.Event, answer: Any) -> tuple[str, threading.Event, Any]:
    """An answer sent only once the test sets gate (or the ceiling passes)."""
    return ("__held__", gate, answer)


def failing(status: int, message: str) -> tuple[str, int, str]:
    """An error answer with this HTTP status and message."""
    return ("__status__", status, message)


@dataclass
class Recorded:
    """One request the server received."""

    body: dict[str, Any]
    headers: dict[str, str]
    at: float

    @property
    def model(self) -> str:
        """The model the request named."""
        return str(self.body.get("model", ""))

    @property
    def prompt(self) -> str:
        """Every message's content, joined."""
        return "\n".join(str(m.get("content", "")) for m in self.body.get("messages", []))

    @property
    def user_message(self) -> str:
        """The first user message (the extraction prompt; a retry appends a reminder)."""
        users = [m for m in self.body.get("messages", []) if m.get("role") == "user"]
        return str(users[0]["content"]) if users else ""

    @property
    def turn(self) -> str:
        """The turn text between <turn> and </turn>."""
        found = re.search(r"<turn>\n(.*)\n</turn>", self.user_message, re.S)
        return found.group(1) if found else ""

    @property
    def is_retry(self) -> bool:
        """Whether this request carries the format reminder."""
        return len([m for m in self.body.get("messages", []) if m.get("role") == "user"]) > 1

    def number_of(self, text: str) -> int:
        """The local number the prompt showed a row containing text under."""
        for line in self.user_message.splitlines():
            found = re.match(r"\[(\d+)\] (.*)", line)
            if found and text in found.group(2):
                return int(found.group(1))
        raise AssertionError(f"{text!r} was not shown:\n{self.user_message}")


@dataclass
class FakeLlm:
    """The server's script and its record; `answer` may replace the script with a function."""

    url: str = ""
    script: deque[Any] = field(default_factory=deque)
    requests: list[Recorded] = field(default_factory=list)
    default: Any = None
    answer: Callable[[Recorded], Any] | None = None
    takes_response_format: bool = True
    _closing: asyncio.Event = field(default_factory=asyncio.Event)

    by_marker: dict[tuple[str, str], deque[Any]] = field(default_factory=dict)

    def push(self, *answers: Any) -> None:
        """Queues answers, served in order to the requests that follow."""
        self.script.extend(answers)

    def on(self, marker: str, *answers: Any, model: str = "") -> None:
        """Answers requests whose turn contains marker (and that name model, if given).

        Answers are served in order; the last one keeps answering.
        """
        self.by_marker[(marker, model)] = deque(answers)

    def for_marker(self, marker: str) -> list[Recorded]:
        """The requests whose turn contained marker."""
        return [r for r in self.requests if marker in r.turn]

    def _scripted(self, record: Recorded) -> Any:
        for (marker, model), answers in self.by_marker.items():
            if marker in record.turn and (not model or model == record.model) and answers:
                return answers.popleft() if len(answers) > 1 else answers[0]
        if self.answer is not None:
            return self.answer(record)
        if self.script:
            return self.script.popleft()
        return self.default

    def for_model(self, model: str) -> list[Recorded]:
        """The requests that named model."""
        return [r for r in self.requests if r.model == model]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        record = Recorded(body, dict(request.headers), time.time())
        self.requests.append(record)
        if not self.takes_response_format and "response_format" in body:
            return _error(400, "response_format is not supported by this server")
        reply = self._scripted(record)
        if callable(reply):
            reply = reply(record)
        if isinstance(reply, tuple) and reply and reply[0] == "__delay__":
            await asyncio.sleep(reply[1])
            reply = reply[2]
        if isinstance(reply, tuple) and reply and reply[0] == "__held__":
            await asyncio.to_thread(reply[1].wait, WAIT_CEILING_S)
            reply = reply[2]
        if isinstance(reply, tuple) and reply and reply[0] == "__status__":
            return _error(reply[1], reply[2])
        if reply == HANG:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), 3600)
            return _error(503, "the fake is shutting down")
        if reply == ERROR:
            return _error(500, "scripted failure")
        if reply == REJECT_FORMAT:
            return _error(400, "response_format is not supported by this server")
        if reply is None:
            reply = {}
        text = reply if isinstance(reply, str) else json.dumps(reply)
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": record.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error"}}, status=status
    )


@contextlib.asynccontextmanager
async def running_fake_llm(host: str = "127.0.0.1") -> AsyncIterator[FakeLlm]:
    """Serves a FakeLlm on host:<free port>; its url ends in /v1."""
    fake = FakeLlm()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake._handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://{host}:{port}/v1"
    try:
        yield fake
    finally:
        fake._closing.set()
        await runner.cleanup()


@contextlib.contextmanager
def fake_llm_in_thread() -> Iterator[FakeLlm]:
    """A FakeLlm served by its own event loop on a thread, for service processes to call."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def serve() -> None:
        async with running_fake_llm() as fake:
            holder["fake"] = fake
            holder["stop"] = asyncio.Event()
            ready.set()
            await holder["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    if not ready.wait(10):
        raise TimeoutError("the fake LLM did not start")
    try:
        yield holder["fake"]
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(10)
        loop.close()
