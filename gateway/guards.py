"""Request guards: anti-rebinding Host check, cross-site/Origin refusal, bearer token."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Set
from urllib.parse import urlsplit

from aiohttp import web

from gateway.errors import Handler
from gateway.state import CONFIG
from shared.errors import PermissionDenied, Unauthenticated

# Liveness and readiness must be reachable by a supervisor that holds no token.
TOKEN_EXEMPT = frozenset({"/healthz", "/readyz"})


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_localhost(host: str) -> bool:
    return host.lower().removesuffix(".") == "localhost"


def host_name(host_header: str) -> str:
    """The host part of a Host header: port and IPv6 brackets removed, lower-cased."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


def host_allowed(host_header: str, allowed: Set[str]) -> bool:
    """Whether a Host header names this machine: empty, localhost, an IP literal or allowlisted."""
    if not host_header.strip():
        return True
    host = host_name(host_header)
    return _is_localhost(host) or _is_ip(host) or host.removesuffix(".") in allowed


def origin_allowed(origin: str, host_header: str, allowed: Set[str]) -> bool:
    """Whether an Origin is http(s) and loopback, the request's own host, or allowlisted."""
    try:
        parts = urlsplit(origin.strip())
        hostname = parts.hostname or ""
    except ValueError:
        return False
    if parts.scheme.lower() not in ("http", "https") or not hostname:
        return False
    if _is_localhost(hostname):
        return True
    if _is_ip(hostname) and ipaddress.ip_address(hostname).is_loopback:
        return True
    if host_header and parts.netloc.lower() == host_header.strip().lower():
        return True
    return hostname.removesuffix(".") in allowed


@web.middleware
async def guards_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuses requests a web page could make on someone's behalf (DNS rebinding, CSRF)."""
    allowed = request.app[CONFIG].allowed_hosts
    host = request.headers.get("Host", "")
    if not host_allowed(host, allowed):
        raise PermissionDenied("non-local Host refused")
    if request.headers.get("Sec-Fetch-Site", "").strip().lower() == "cross-site":
        raise PermissionDenied("cross-site request refused")
    origin = request.headers.get("Origin")
    if origin is not None and not origin_allowed(origin, host, allowed):
        raise PermissionDenied("cross-origin request refused")
    return await handler(request)


@web.middleware
async def token_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With HYATLAS_TOKEN set, every route but /healthz and /readyz needs a bearer token."""
    token = request.app[CONFIG].token
    # A handler may mark itself public (the dashboard's static shell, which asks for the token).
    public = getattr(request.match_info.handler, "token_exempt", False)
    if token and request.path not in TOKEN_EXEMPT and not public:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # Compared in constant time so the token cannot be guessed byte by byte.
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), token.encode()
        )
        if not ok:
            raise Unauthenticated("a valid bearer token is required (Authorization: Bearer ...)")
    return await handler(request)
