"""LLM access: key sources, primary and fallback endpoints, JSON replies with one retry."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from shared.errors import ServiceError, Unavailable
from shared.redact import redact_text
from shared.settings import LlmSettings

if TYPE_CHECKING:
    import openai

log = logging.getLogger(__name__)

REMINDER = (
    "Your previous reply was not a valid JSON object. Reply again with exactly one JSON object "
    "in the format described, and nothing else: no prose, no code fences."
)
_OPENING_FENCE = re.compile(r"```[a-zA-Z0-9_-]*")
MAX_REPLY_CHARS = 100_000
"""The longest reply parsed (some 25,000 tokens, far past what any prompt here asks for): a
longer one is a runaway generation, and refusing it bounds the work a parse does on the loop."""
MAX_OBJECT_STARTS = 16
"""How many "{" a reply that is not one JSON object is searched from for the first object: each
try is linear, so a reply of nothing but braces costs a bounded number of passes."""
_DECODER = json.JSONDecoder()
# The primary's share of one call's time when a fallback stands behind it.
PRIMARY_SHARE = 2 / 3
DEFAULT_MAX_TOKENS = 1024
# How a call asks for JSON, most specific first; a server that refuses one form gets the next.
JSON_SCHEMA, OBJECT_WITH_SCHEMA, JSON_OBJECT, NO_FORMAT = range(4)
# Words in an error that show the server refused the reply format rather than failed.
_FORMAT_WORDS = ("response_format", "json_schema", "json_object", "'text'")


class LlmUnavailable(Unavailable):
    """Every endpoint failed for a reason of its own: an error, a timeout, no answer."""


class LlmMalformed(ServiceError):
    """The model's reply was not a JSON object, even after the reminder."""


class LlmRefused(LlmMalformed):
    """Every endpoint refused this very request (HTTP 400, 413 or 422: a prompt too long, a
    content filter) or gave an empty reply: something of the request, not of the server, so
    it counts a try of the row as a malformed reply does and others are asked meanwhile."""


REFUSALS = frozenset({400, 413, 422})
"""HTTP statuses a model's server gives for the request itself (not for a key, a model
name or its load): asking again with the same request will fail again."""


@dataclass(frozen=True)
class ReplySchema:
    """The JSON schema one kind of reply is asked to follow, under a short name."""

    name: str
    schema: dict[str, Any]


def object_schema(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object schema of these properties; all are required unless required names some."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
    }


def array_of(items: dict[str, Any]) -> dict[str, Any]:
    """An array schema whose items follow items."""
    return {"type": "array", "items": items}


def response_format(form: int, reply: ReplySchema) -> dict[str, Any] | None:
    """The response_format of one form (None: send none)."""
    if form == JSON_SCHEMA:
        return {
            "type": "json_schema",
            "json_schema": {"name": reply.name, "schema": reply.schema, "strict": False},
        }
    if form == OBJECT_WITH_SCHEMA:
        # llama-cpp-python's own form: it turns the schema into a grammar.
        return {"type": "json_object", "schema": reply.schema}
    if form == JSON_OBJECT:
        return {"type": "json_object"}
    return None


def refuses_format(exc: openai.APIStatusError) -> bool:
    """Whether an error answer refuses the reply format (as opposed to the model failing)."""
    if exc.status_code == 400:
        return True
    text = str(exc).lower()
    return exc.status_code in (422, 500) and any(word in text for word in _FORMAT_WORDS)


@dataclass(frozen=True)
class Endpoint:
    """One model at one base URL, with the key it is sent (None: no Authorization header)."""

    base: str
    model: str
    key: str | None
    timeout_s: float


DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_of(url: str) -> tuple[str, str, int | None]:
    """A URL's scheme, lower-cased host and port (the scheme's own when none is written): what
    tells one server from another (another port on one host is another server)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or DEFAULT_PORTS.get(scheme)



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
        max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        self.base = base
        self.model = model
        self.keys = keys
        self.timeout_s = timeout_s
        self.fallback_model = fallback_model
        self.fallback_base = fallback_base or base
        self.fallback_key = fallback_key
        self.max_tokens = max_tokens
        # The form each endpoint last answered in; one not listed starts at JSON_SCHEMA.
        self._forms: dict[tuple[str, str], int] = {}

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
        elif origin_of(self.fallback_base) == origin_of(self.base):
            fallback_key = primary_key
        else:
            # The primary's key never goes to another server (host, port or scheme).
            fallback_key = None
        share = self.timeout_s * PRIMARY_SHARE
        return [
            Endpoint(self.base, self.model, primary_key, share),
            Endpoint(self.fallback_base, self.fallback_model, fallback_key, self.timeout_s - share),
        ]

    def form_of(self, endpoint: Endpoint) -> int:
        """The reply format an endpoint is asked for next (JSON_SCHEMA .. NO_FORMAT)."""
        return self._forms.get((endpoint.base, endpoint.model), JSON_SCHEMA)

    async def json_reply(
        self, messages: list[dict[str, str]], schema: ReplySchema
    ) -> dict[str, Any]:
        """The model's reply as a JSON object; one retry with a reminder when it is malformed.

        The schema guides the model where the server takes one; the reply is still checked by
        its caller, since no server is relied on to enforce it.
        """
        reply = await self.complete(messages, schema)
        try:
            return parse_json_object(reply)
        except ValueError as exc:
            log.info("unparseable reply (%s); retrying once with a format reminder", exc)
        retry = [
            *messages,
            {"role": "assistant", "content": reply[:4000]},
            {"role": "user", "content": REMINDER},
        ]
        reply = await self.complete(retry, schema)
        try:
            return parse_json_object(reply)
        except ValueError as exc:
            raise LlmMalformed(f"the model's reply is not a JSON object: {exc}") from None

    async def complete(self, messages: list[dict[str, str]], schema: ReplySchema) -> str:
        """One completion: each endpoint in turn, and the whole round once more if all fail."""
        errors: list[str] = []
        refused = True
        for _round in range(2):
            for endpoint in self.endpoints():
                try:
                    return await self._call(endpoint, messages, schema)
                except (LlmUnavailable, LlmRefused) as exc:
                    log.warning("llm %s at %s failed: %s", endpoint.model, endpoint.base, exc)
                    errors.append(f"{endpoint.model}: {exc.message}")
                    refused = refused and isinstance(exc, LlmRefused)
            if refused:
                break  # the same request would be refused again
        raise (LlmRefused if refused else LlmUnavailable)("; ".join(errors[-2:]))

    async def _call(
        self, endpoint: Endpoint, messages: list[dict[str, str]], schema: ReplySchema
    ) -> str:
        # Imported on the first call: lite mode never calls, and the client costs ~35 MiB.
        import openai

        deadline = time.monotonic() + endpoint.timeout_s
        headers: dict[str, Any] = {}
        if endpoint.key is None or not endpoint.key:
            headers["Authorization"] = openai.Omit()
        form = self.form_of(endpoint)
        async with openai.AsyncOpenAI(
            base_url=endpoint.base,
            api_key=endpoint.key or "none",
            max_retries=0,
            timeout=endpoint.timeout_s,
        ) as client:
            while True:
                extra: dict[str, Any] = {}
                wanted = response_format(form, schema)
                if wanted is not None:
                    extra["response_format"] = wanted
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LlmUnavailable(f"timed out after {endpoint.timeout_s:g}s")
                try:
                    async with asyncio.timeout(left):
                        answer = await client.chat.completions.create(
                            model=endpoint.model,
                            messages=messages,  # type: ignore[arg-type]
                            temperature=0,
                            # Without a cap a small model under a JSON grammar may never stop.
                            max_tokens=self.max_tokens,
                            extra_headers=headers,
                            timeout=left,
                            **extra,
                        )
                except TimeoutError:
                    raise LlmUnavailable(f"timed out after {endpoint.timeout_s:g}s") from None
                except openai.APITimeoutError:
                    raise LlmUnavailable(f"timed out after {endpoint.timeout_s:g}s") from None
                except openai.APIStatusError as exc:
                    if form != NO_FORMAT and refuses_format(exc):
                        # The server does not take this format: ask again in the next one.
                        log.info(
                            "%s at %s refuses response_format form %d (%s); trying the next",
                            endpoint.model, endpoint.base, form, _short(exc),
                        )
                        form += 1
                        continue
                    failure = LlmRefused if exc.status_code in REFUSALS else LlmUnavailable
                    raise failure(f"HTTP {exc.status_code}: {_short(exc)}") from exc
                except openai.OpenAIError as exc:
                    raise LlmUnavailable(redact_text(str(exc)) or type(exc).__name__) from exc
                # Only a form that got an answer is remembered, so a 400 for another reason
                # (a prompt too long, say) never downgrades the endpoint for later calls.
                self._forms[(endpoint.base, endpoint.model)] = form
                choices = answer.choices or []
                text = (choices[0].message.content or "") if choices else ""
                if not text.strip():
                    raise LlmRefused("empty reply")
                return text


def _short(exc: openai.APIStatusError) -> str:
    # An error may quote the URL it was sent to, credentials and all.
    return redact_text(str(exc))[:300]


def shown_number(value: Any) -> int | None:
    """The number a model wrote for an item it was shown (3, "3", "[3]", "[ 3 ]"); None for
    anything else: a bool, a word, or a digit int() does not read ("²")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip().strip("[]").strip()
        if text.isdecimal():
            return int(text)
    return None


def parse_json_object(text: str) -> dict[str, Any]:
    """The first JSON object in text, after code fences; ValueError if there is none, if it
    nests too deeply to decode, or if the text is longer than MAX_REPLY_CHARS."""
    if len(text) > MAX_REPLY_CHARS:
        raise ValueError(f"reply has {len(text):,} characters; at most {MAX_REPLY_CHARS:,} read")
    unfenced = _unfenced(text)
    try:
        value = json.loads(unfenced)
    except (ValueError, RecursionError):
        value = _first_object(unfenced)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _unfenced(text: str) -> str:
    """text without a Markdown code fence around it; the closing fence is found with endswith,
    since a regex anchored at the end rescans every run of spaces (quadratic in a long reply)."""
    text = text.strip()
    opening = _OPENING_FENCE.match(text)
    if opening:
        text = text[opening.end() :]
    if text.endswith("```"):
        text = text[:-3]
    return text.strip()


def _first_object(text: str) -> dict[str, Any]:
    """The object decoded from the first of up to MAX_OBJECT_STARTS "{" that starts one."""
    start = text.find("{")
    for _try in range(MAX_OBJECT_STARTS):
        if start == -1:
            break
        try:
            value, _end = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):
            start = text.find("{", start + 1)
            continue
        return value
    raise ValueError("no JSON object found")


def llm_client(settings: LlmSettings) -> LlmClient:
    """A client for the LLM settings in force."""
    return LlmClient(
        base=settings.base,
        model=settings.model,
        keys=LlmKeys(settings.key, settings.key_file),
        timeout_s=settings.timeout_s,
        fallback_model=settings.fallback_model,
        fallback_base=settings.fallback_base,
        fallback_key=settings.fallback_key,
        max_tokens=settings.max_tokens,
    )
