"""LLM access: key sources, primary and fallback endpoints, JSON replies with one retry."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import openai
from openai import AsyncOpenAI

from shared.errors import ServiceError, Unavailable

log = logging.getLogger(__name__)

REMINDER = (
    "Your previous reply was not a valid JSON object. Reply again with exactly one JSON object "
    "in the format described, and nothing else: no prose, no code fences."
)
_FENCE = re.compile(r"^```[a-zA-Z0-9_-]*\s*|\s*```$")
# The primary's share of one call's time when a fallback stands behind it.
PRIMARY_SHARE = 2 / 3


class LlmUnavailable(Unavailable):
    """Every endpoint failed: an error, an empty reply or a timeout."""


class LlmMalformed(ServiceError):
    """The model's reply was not a JSON object, even after the reminder."""


@dataclass(frozen=True)
class Endpoint:
    """One model at one base URL, with the key it is sent (None: no Authorization header)."""

    base: str
    model: str
    key: str | None
    timeout_s: float


def host_of(url: str) -> str:
    """The lower-cased host of a URL ("" when it has none)."""
    return (urlsplit(url).hostname or "").lower()


class LlmKeys:
    """Where the primary key comes from: a posted key, then the key file, then HYATLAS_LLM_KEY."""

    def __init__(self, env_key: str, key_file: str) -> None:
        self._env_key = env_key
        self._key_file = key_file
        self._posted = ""
        self._warned: set[str] = set()

    def post(self, key: str) -> None:
        """Keeps a handed-over key in memory; it wins over both other sources."""
        self._posted = key.strip()

    def current(self) -> str:
        """The key to send now ("" when there is none); the file is read on every call."""
        if self._posted:
            return self._posted
        if self._key_file:
            key = self._read_file()
            if key:
                return key
        return self._env_key

    def _read_file(self) -> str:
        try:
            with open(self._key_file, encoding="utf-8") as handle:
                text = handle.read().strip()
        except OSError as exc:
            self._warn_once(
                "unreadable", "HYATLAS_LLM_KEY_FILE cannot be read (%s); using HYATLAS_LLM_KEY", exc
            )
            return ""
        if text.startswith("{"):
            # A JSON file is some program's credential store, never a key of ours.
            self._warn_once(
                "json",
                "HYATLAS_LLM_KEY_FILE holds JSON, not a plain-text key; "
                "refusing it and using HYATLAS_LLM_KEY",
            )
            return ""
        return text

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message, *args)


class LlmClient:
    """Chat completions against the primary model, falling back to the second one on failure."""

    def __init__(
        self,
        base: str,
        model: str,
        keys: LlmKeys,
        timeout_s: float,
        fallback_model: str = "",
        fallback_base: str = "",
        fallback_key: str | None = None,
    ) -> None:
        self.base = base
        self.model = model
        self.keys = keys
        self.timeout_s = timeout_s
        self.fallback_model = fallback_model
        self.fallback_base = fallback_base or base
        self.fallback_key = fallback_key
        self._no_response_format: set[tuple[str, str]] = set()

    @property
    def configured(self) -> bool:
        """Whether base and model are set (a key may still be missing)."""
        return bool(self.base and self.model)

    def has_key(self) -> bool:
        """Whether some source gives the primary a key right now."""
        return bool(self.keys.current())

    def endpoints(self) -> list[Endpoint]:
        """The endpoints one call tries, in order, each with its share of the time."""
        primary_key = self.keys.current()
        if not self.fallback_model:
            return [Endpoint(self.base, self.model, primary_key, self.timeout_s)]
        if self.fallback_key is not None:
            fallback_key: str | None = self.fallback_key or None
        elif host_of(self.fallback_base) == host_of(self.base):
            fallback_key = primary_key
        else:
            # The primary's key never goes to another host.
            fallback_key = None
        share = self.timeout_s * PRIMARY_SHARE
        return [
            Endpoint(self.base, self.model, primary_key, share),
            Endpoint(self.fallback_base, self.fallback_model, fallback_key, self.timeout_s - share),
        ]

    async def json_reply(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        """The model's reply as a JSON object; one retry with a reminder when it is malformed."""
        reply = await self.complete(messages)
        try:
            return parse_json_object(reply)
        except ValueError as exc:
            log.info("unparseable reply (%s); retrying once with a format reminder", exc)
        retry = [
            *messages,
            {"role": "assistant", "content": reply[:4000]},
            {"role": "user", "content": REMINDER},
        ]
        reply = await self.complete(retry)
        try:
            return parse_json_object(reply)
        except ValueError as exc:
            raise LlmMalformed(f"the model's reply is not a JSON object: {exc}") from None

    async def complete(self, messages: list[dict[str, str]]) -> str:
        """One completion: each endpoint in turn, and the whole round once more if all fail."""
        errors: list[str] = []
        for _round in range(2):
            for endpoint in self.endpoints():
                try:
                    return await self._call(endpoint, messages)
                except LlmUnavailable as exc:
                    log.warning("llm %s at %s failed: %s", endpoint.model, endpoint.base, exc)
                    errors.append(f"{endpoint.model}: {exc.message}")
        raise LlmUnavailable("; ".join(errors[-2:]))

    async def _call(self, endpoint: Endpoint, messages: list[dict[str, str]]) -> str:
        deadline = time.monotonic() + endpoint.timeout_s
        headers: dict[str, Any] = {}
        if endpoint.key is None or not endpoint.key:
            headers["Authorization"] = openai.Omit()
        async with AsyncOpenAI(
            base_url=endpoint.base,
            api_key=endpoint.key or "none",
            max_retries=0,
            timeout=endpoint.timeout_s,
        ) as client:
            while True:
                with_format = (endpoint.base, endpoint.model) not in self._no_response_format
                extra: dict[str, Any] = {}
                if with_format:
                    extra["response_format"] = {"type": "json_object"}
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LlmUnavailable(f"timed out after {endpoint.timeout_s:g}s")
                try:
                    async with asyncio.timeout(left):
                        answer = await client.chat.completions.create(
                            model=endpoint.model,
                            messages=messages,  # type: ignore[arg-type]
                            temperature=0,
                            extra_headers=headers,
                            timeout=left,
                            **extra,
                        )
                except TimeoutError:
                    raise LlmUnavailable(f"timed out after {endpoint.timeout_s:g}s") from None
                except openai.APITimeoutError:
                    raise LlmUnavailable(f"timed out after {endpoint.timeout_s:g}s") from None
                except openai.BadRequestError as exc:
                    if with_format and "response_format" in str(exc):
                        # This server does not take response_format: ask again without it.
                        self._no_response_format.add((endpoint.base, endpoint.model))
                        log.info(
                            "%s does not take response_format; using the tolerant parser",
                            endpoint.model,
                        )
                        continue
                    raise LlmUnavailable(f"bad request: {exc}") from exc
                except openai.OpenAIError as exc:
                    raise LlmUnavailable(str(exc) or type(exc).__name__) from exc
                choices = answer.choices or []
                text = (choices[0].message.content or "") if choices else ""
                if not text.strip():
                    raise LlmUnavailable("empty reply")
                return text


def parse_json_object(text: str) -> dict[str, Any]:
    """The first JSON object in text, after code fences; ValueError if there is none."""
    stripped = _FENCE.sub("", text.strip()).strip()
    try:
        value = json.loads(stripped)
    except ValueError:
        block = _first_object(stripped)
        if block is None:
            raise ValueError("no JSON object found") from None
        value = json.loads(block)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _first_object(text: str) -> str | None:
    """The first balanced {...} block, skipping braces inside strings."""
    start = text.find("{")
    while start != -1:
        depth, in_string, escaped = 0, False, False
        for i in range(start, len(text)):
            ch = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    block = text[start : i + 1]
                    try:
                        json.loads(block)
                    except ValueError:
                        break
                    return block
        start = text.find("{", start + 1)
    return None
