"""A small blocking REST client for the HyAtlas gateway (standard library only)."""

from __future__ import annotations

import datetime as dt
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

USER_AGENT = "hermes-hyatlas/5.0"


class ClientError(Exception):
    """A request to the gateway failed."""


class Unreachable(ClientError):
    """The gateway did not answer (connection refused, timeout, DNS)."""


class NotHyAtlas(ClientError):
    """Something answered at server_url, but not the way a HyAtlas gateway answers (another
    service, such as an OpenAI-compatible server, that replies 200 with JSON of its own)."""

    def __init__(self, method: str, path: str, base_url: str, reply: Any) -> None:
        self.detail = f"{method} {path} answered {_first_words(json.dumps(reply))}"
        super().__init__(f"{base_url} is not a HyAtlas server ({self.detail}); check server_url "
                         "(hyatlas.json, HYATLAS_SERVER_URL)")


class HttpError(ClientError):
    """The gateway answered with an HTTP error status."""

    def __init__(self, method: str, path: str, status: int, message: str,
                 from_gateway: bool = False) -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.from_gateway = from_gateway
        """Whether the body is the gateway's JSON error ({"error": ...}), not another server's."""


class HyAtlasClient:
    """Calls the gateway's /api/v1 routes and returns their JSON bodies."""

    def __init__(self, base_url: str, *, timeout_s: float = 10.0, token: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._token = token

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        query: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """Sends one request; returns the decoded JSON, raises Unreachable or HttpError."""
        url = self.base_url + path
        if query:
            pairs = {k: well_formed(str(v)) for k, v in query.items() if v not in (None, "")}
            url += "?" + urllib.parse.urlencode(pairs)
        data = None if body is None else json.dumps(well_formed(body)).encode("utf-8")
        sent = {"Accept": "application/json", "User-Agent": USER_AGENT, **(headers or {})}
        if data is not None:
            sent["Content-Type"] = "application/json"
        if self._token:
            sent["Authorization"] = f"Bearer {self._token}"
        req = urllib.request.Request(url, data=data, method=method, headers=sent)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            with urllib.request.urlopen(req, timeout=timeout) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            error = _gateway_error(raw)
            # Another service's page (a proxy's, a web server's): its first words, on one line.
            message = error if error is not None else " ".join(
                raw[:300].decode("utf-8", "replace").split())[:80]
            raise HttpError(method, path, exc.code, message, error is not None) from None
        except (TimeoutError, urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise Unreachable(
                f"{method} {path}: gateway unreachable at {self.base_url} ({reason})"
            ) from None
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise ClientError(f"{method} {path}: answer is not JSON: {raw[:200]!r}") from None

    def _expect(self, method: str, path: str, reply: Any, shape: Callable[[Any], bool]) -> Any:
        """reply when it has the shape the gateway answers path with; else NotHyAtlas."""
        if not shape(reply):
            raise NotHyAtlas(method, path, self.base_url, reply)
        return reply

    def healthy(self, timeout_s: float = 1.0) -> bool:
        """Whether /healthz answers {"status": "ok"}."""
        try:
            reply = self.request("GET", "/healthz", timeout_s=timeout_s)
        except ClientError:
            return False
        return isinstance(reply, dict) and reply.get("status") == "ok"

    def ready(self, timeout_s: float = 2.0) -> bool:
        """Whether /readyz says every backing service answers (/healthz on a server without
        it); raises NotHyAtlas when what answers is not a HyAtlas gateway."""
        try:
            reply = self.request("GET", "/readyz", timeout_s=timeout_s)
        except HttpError as exc:
            # A server that predates /readyz (the reference's own) only tells liveness.
            return exc.status == 404 and self.healthy(timeout_s) and self._answers_status(
                timeout_s)
        except ClientError:
            return False
        return self._expect("GET", "/readyz", reply, is_readiness)["ready"] is True

    def _answers_status(self, timeout_s: float) -> bool:
        """Whether the status route answers as a gateway's does (its own JSON error, such as a
        refused token, too); raises NotHyAtlas when it answers otherwise."""
        try:
            self.status(timeout_s=timeout_s)
        except HttpError as exc:
            return exc.from_gateway
        except NotHyAtlas:
            raise
        except ClientError:
            return False
        return True

    def status(self, **kwargs: Any) -> dict[str, Any]:
        """GET /api/v1/status (a reply without version, mode and layers is not a gateway's)."""
        path = "/api/v1/status"
        return self._expect("GET", path, self.request("GET", path, **kwargs), is_status)

    def add(self, payload: dict[str, Any], idempotency_key: str = "") -> dict[str, Any]:
        """POST /api/v1/add with {text, user_id, agent_id, session_id, metadata}; a write sent
        again with the same idempotency_key is stored once."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        reply = self.request("POST", "/api/v1/add", payload, headers=headers)
        return self._expect("POST", "/api/v1/add", reply, is_added)

    def search(
        self,
        query: str,
        *,
        user_id: str,
        agent_id: str,
        limit: int = 10,
        layer: str = "",
        session_id: str = "",
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """POST /api/v1/search; returns the body with its `memories` channels.

        The query's dates ("yesterday", "in May") are read by this machine's clock and zone.
        """
        body: dict[str, Any] = {
            "query": query,
            "user_id": user_id,
            "agent_id": agent_id,
            "limit": limit,
            "reference_time": local_now(),
        }
        if layer:
            body["layer"] = layer
        if session_id:
            body["session_id"] = session_id
        reply = self.request("POST", "/api/v1/search", body, timeout_s=timeout_s)
        return self._expect("POST", "/api/v1/search", reply, is_search)

    def recent(
        self, *, user_id: str, agent_id: str, limit: int = 20, layer: str = "",
        include_raw: bool = True, offset: int = 0, include_superseded: bool = False,
        before: str = "", contains: str = "",
    ) -> dict[str, Any]:
        """POST /api/v1/list, newest first; from offset on, or after the row `before` names (a
        page's next_before); with contains, only the rows whose text holds it (any case)."""
        body: dict[str, Any] = {
            "user_id": user_id,
            "agent_id": agent_id,
            "limit": limit,
            "offset": offset,
            "include_raw": include_raw,
            "include_superseded": include_superseded,
        }
        if layer:
            body["layer"] = layer
        if before:
            body["before"] = before
        if contains:
            body["contains"] = contains
        return self._expect("POST", "/api/v1/list", self.request("POST", "/api/v1/list", body),
                            is_list)

    def owners(self) -> dict[str, Any]:
        """GET /api/v1/owners: every user and agent with memories, counts and last write."""
        path = "/api/v1/owners"
        return self._expect("GET", path, self.request("GET", path), is_owners)

    def forget(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /api/v1/forget: retire the memories matching a text or id (reversible)."""
        reply = self.request("POST", "/api/v1/forget", payload)
        return self._expect("POST", "/api/v1/forget", reply, is_forgotten)

    def restore(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /api/v1/restore: bring one retired memory back ({memory_id, user_id, agent_id})."""
        reply = self.request("POST", "/api/v1/restore", payload)
        return self._expect("POST", "/api/v1/restore", reply, is_restored)

    def flush(self) -> dict[str, Any]:
        """POST /api/v1/flush: ask the server to persist what it holds in memory."""
        return self.request("POST", "/api/v1/flush", {})

    def set_llm_key(self, key: str) -> dict[str, Any]:
        """POST /api/v1/llm/key: hand the extraction key to the server (kept in its memory)."""
        return self.request("POST", "/api/v1/llm/key", {"key": key})


def local_now() -> str:
    """Now by this machine's clock and zone, in RFC 3339 (a search's reference_time, and an
    add's event_at: when it was said, which a write delivered late from the queue keeps)."""
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _has(reply: Any, **kinds: type) -> bool:
    """Whether reply is a JSON object whose named fields hold values of those kinds."""
    return isinstance(reply, dict) and all(_of_kind(reply.get(name), kind)
                                           for name, kind in kinds.items())


def _of_kind(value: Any, kind: type) -> bool:
    # JSON true is no count, though Python's bool is an int.
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def is_added(reply: Any) -> bool:
    """An add's answer: success true and the new row's memory_id."""
    return _has(reply, memory_id=str) and reply.get("success") is True and bool(reply["memory_id"])


def is_forgotten(reply: Any) -> bool:
    """A forget's answer: how many rows it retired, and which."""
    return _has(reply, forgotten=int, memories=list)


def is_restored(reply: Any) -> bool:
    """A restore's answer: whether it brought the row back, and the row."""
    return _has(reply, restored=bool, memory=dict)


def is_status(reply: Any) -> bool:
    """A status answer: the server's version and mode, and its live rows per layer."""
    return _has(reply, version=str, mode=str, layers=dict)


def is_readiness(reply: Any) -> bool:
    """A readiness answer: whether the server is ready, and the state of each service."""
    return _has(reply, status=str, ready=bool, services=dict)


def is_search(reply: Any) -> bool:
    """A search answer: its channels of memories."""
    return _has(reply, memories=dict)


def is_list(reply: Any) -> bool:
    """A list answer: a page of memories."""
    return _has(reply, memories=list)


def is_owners(reply: Any) -> bool:
    """An owners answer: its users, each with its agents."""
    return _has(reply, users=list)


def _first_words(text: str) -> str:
    """The start of another service's answer, on one line."""
    words = " ".join(text.split())
    return words if len(words) <= 80 else words[:79] + "…"


def well_formed(value: Any) -> Any:
    """value with each lone surrogate and NUL character in its strings (and keys) replaced by
    U+FFFD.

    Text Python read with surrogateescape (a terminal's non-UTF-8 byte) holds lone surrogates,
    and pasted binary text NULs; the gateway refuses such a body for good, so the rest of the
    turn would be lost with them.
    """
    if isinstance(value, str):
        # Through UTF-16, a proper surrogate pair becomes its character and a lone one U+FFFD.
        text = value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
        return text.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {well_formed(k): well_formed(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [well_formed(item) for item in value]
    return value


def _gateway_error(raw: bytes) -> str | None:
    """The message of the gateway's error body {"error": "..."}; None for any other body."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"]:
        return body["error"]
    return None
