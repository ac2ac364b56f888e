"""Who a bearer token is: the tokens file and HYATLAS_TOKEN, and the scope each route needs."""

from __future__ import annotations

import hmac
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from shared.errors import ConfigError
from shared.grants import ANY, SCOPES, Grant

log = logging.getLogger(__name__)

READ, WRITE, ADMIN = SCOPES

ROUTE_SCOPES: dict[str, str] = {
    "/api/v1/status": READ,
    "/api/v1/metrics": READ,
    "/api/v1/list": READ,
    "/api/v1/search": READ,
    "/api/v1/history": READ,
    "/api/v1/owners": READ,
    "/api/v1/graph": READ,
    "/api/v1/graph-as-of": READ,
    "/api/v1/edges": READ,
    "/api/v1/learning/graph": READ,
    "/api/v1/export": READ,
    "/dashboard/api/memory": READ,
    "/dashboard/api/writes": READ,
    "/dashboard/api/system": READ,
    "/dashboard/api/search-stages": READ,
    "/api/v1/openapi.json": READ,
    # Request and call counters of the whole server: the handler also needs a grant reaching
    # every owner.
    "/metrics": READ,
    "/api/v1/add": WRITE,
    "/api/v1/update": WRITE,
    "/api/v1/restore": WRITE,
    "/api/v1/forget": WRITE,
    "/api/v1/feedback": WRITE,
    "/api/v1/delete_all": WRITE,
    # Saves the vector indexes: changes nothing a reader sees, and the plugin calls it.
    "/api/v1/flush": WRITE,
    # These act on every owner at once (or on the server itself).
    "/api/v1/digest": ADMIN,
    "/api/v1/digest/undo": ADMIN,
    "/api/v1/undo_pass": ADMIN,
    "/api/v1/reprocess": ADMIN,
    "/api/v1/llm/key": ADMIN,
    "/api/v1/import": ADMIN,
    "/api/v1/admin/compact_raw": ADMIN,
    "/api/v1/admin/dedupe_facts": ADMIN,
    "/api/v1/admin/snapshot": ADMIN,
}
"""The scope each route needs, by its path; a route missing here needs admin."""

TOKENS: web.AppKey[TokenBook] = web.AppKey("tokens")
GRANT: web.RequestKey[Grant] = web.RequestKey("grant", Grant)
"""The grant of the request's token, once the token check has passed."""


def scope_for(request: web.Request) -> str:
    """The scope the request's route needs (read where no route matched: it answers 404)."""
    resource = request.match_info.route.resource
    return READ if resource is None else ROUTE_SCOPES.get(resource.canonical, ADMIN)


def _strings(entry: dict[str, Any], key: str, where: str) -> list[str]:
    values = entry.get(key)
    if not isinstance(values, list) or not values or not all(
        isinstance(v, str) and v for v in values
    ):
        raise ValueError(f"{where}: {key!r} must be a non-empty list of names (\"*\": any)")
    return values


def _grant(entry: Any, where: str) -> tuple[str, Grant]:
    """One token entry: its secret and its grant."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not an object")
    name, token = entry.get("name"), entry.get("token")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: 'name' must be a non-empty string")
    if not isinstance(token, str) or len(token) < 16:
        raise ValueError(f"{where}: 'token' must be a string of at least 16 characters")
    scopes = _strings(entry, "scopes", where)
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise ValueError(f"{where}: unknown scope {', '.join(unknown)} (read, write, admin)")
    users, agents = _strings(entry, "users", where), _strings(entry, "agents", where)
    if ADMIN in scopes and (ANY not in users or ANY not in agents):
        # Admin routes act on every owner at once, so only a token that reaches all may use them.
        raise ValueError(f"{where}: the admin scope needs users [\"*\"] and agents [\"*\"]")
    return token, Grant.build(name.strip(), users, agents, scopes)


def parse_tokens(text: str) -> list[tuple[str, Grant]]:
    """The (token, grant) pairs of a tokens file; ValueError says what is wrong."""
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
        raise ValueError('expected {"tokens": [...]}')
    pairs = [_grant(entry, f"tokens[{i}]") for i, entry in enumerate(data["tokens"])]
    names = [grant.name for _, grant in pairs]
    secrets = [token for token, _ in pairs]
    if len(set(names)) < len(names) or len(set(secrets)) < len(secrets):
        raise ValueError("every token needs its own name and its own secret")
    return pairs


@dataclass
class TokenBook:
    """The tokens the gateway accepts; the tokens file is read again when it changes."""

    token: str = ""
    """HYATLAS_TOKEN: one token granting every owner and scope."""
    path: Path | None = None
    """HYATLAS_TOKENS_FILE."""
    _pairs: list[tuple[str, Grant]] = field(default_factory=list)
    _seen: tuple[int, int, int] | None = None

    @classmethod
    def open(cls, token: str, path: Path | None) -> TokenBook:
        """The book as the settings give it; a bad tokens file is a ConfigError."""
        book = cls(token, path)
        if path is not None:
            try:
                book._load(path)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"HYATLAS_TOKENS_FILE={str(path)!r}: {exc}") from exc
        return book

    @property
    def configured(self) -> bool:
        """Whether any token is required at all."""
        return bool(self.token) or self.path is not None

    def _load(self, path: Path) -> None:
        stat = path.stat()
        self._pairs = parse_tokens(path.read_text(encoding="utf-8"))
        self._seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)

    def _refresh(self) -> None:
        """Reads the file again if it changed; a bad one keeps the grants in force."""
        if self.path is None:
            return
        try:
            stat = self.path.stat()
            seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except OSError:
            seen = (-1, -1, -1)
        if seen == self._seen:
            return
        # Reported once per change of the file, not on every request.
        self._seen = seen
        try:
            self._pairs = parse_tokens(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.error("tokens file %s not applied, the previous tokens stay: %s", self.path, exc)
            return
        log.info("tokens file %s read again: %d tokens", self.path, len(self._pairs))

    def resolve(self, authorization: str) -> Grant | None:
        """The grant of an Authorization header's bearer token, None if it names none."""
        self._refresh()
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        # A header's bytes that are not UTF-8 arrive as surrogate escapes: given back as bytes.
        secret = given.strip().encode("utf-8", "surrogateescape")
        found = None
        # Every token is compared, in constant time, so timing tells nothing about any of them.
        if self.token and hmac.compare_digest(secret, self.token.encode()):
            found = Grant("HYATLAS_TOKEN", audited=False)
        for token, grant in self._pairs:
            if hmac.compare_digest(secret, token.encode()) and found is None:
                found = grant
        return found
