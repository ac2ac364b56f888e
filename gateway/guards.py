"""Request guards: anti-rebinding Host check, cross-site/Origin refusal, bearer token and scope."""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Set
from urllib.parse import urlsplit

from aiohttp import web

from gateway.errors import Handler
from gateway.grants import GRANT, TOKENS, scope_for
from gateway.state import CONFIG
from shared.addresses import is_loopback_host
from shared.errors import PermissionDenied, ServiceError, Unauthenticated
from shared.grants import CURRENT_GRANT

log = logging.getLogger(__name__)

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
        inside, _, rest = host[1:].partition("]")
        # Anything but a port after the brackets is no host name ("[::1]evil.com").
        return inside if re.fullmatch(r"(:\d*)?", rest) else host
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
    # A browser's Origin is scheme, host and port: user info or a path is none it sent.
    if parts.scheme.lower() not in ("http", "https") or not hostname or "@" in parts.netloc:
        return False
    if is_loopback_host(hostname):
        return True
    if host_header and parts.netloc.lower() == host_header.strip().lower():
        return True
    return hostname.removesuffix(".") in allowed


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
JSON_TYPE = "application/json"
"""The one content type a write from another origin may have: a page can send it there only
after asking the server first (a CORS preflight), which this server never grants. Every other
type goes without asking: a form's, a no-cors fetch's (text/plain), and the browser's own
posts (a CSP violation report, application/csp-report, to any address a page names; a link's
ping, text/ping); each route also reads its parameters from the query string."""


def _written_without_asking(request: web.Request, origin: str, host: str) -> bool:
    """Whether a write comes from a page on another origin the Origin rule lets through (a
    loopback one on another port, say) as something other than JSON: a form, a no-cors fetch
    or a report the browser sends for the page."""
    if request.method in SAFE_METHODS:
        return False
    # origin_allowed has parsed the Origin already.
    own = bool(host) and urlsplit(origin.strip()).netloc.lower() == host.strip().lower()
    kind = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    return not own and kind != JSON_TYPE


def _log_refusal(request: web.Request, exc: ServiceError) -> None:
    grant = request.get(GRANT)
    log.warning(
        "refused %s %s for %s: %d %s", request.method, request.path,
        grant.name if grant is not None else "anonymous", exc.http_status, exc.message,
    )


@web.middleware
async def guards_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuses requests a web page could make on someone's behalf (DNS rebinding, CSRF); logs
    every 401 and 403, these and the token check's alike."""
    try:
        _check_origin(request)
        return await handler(request)
    except (Unauthenticated, PermissionDenied) as exc:
        _log_refusal(request, exc)
        raise


def _public(request: web.Request) -> bool:
    """Whether the route's handler marked itself public (the dashboard's static shell, which
    asks for the token)."""
    return bool(getattr(request.match_info.handler, "token_exempt", False))


def _public_page_opened(request: web.Request) -> bool:
    """Whether a browser is opening a public page in a tab (a link to the dashboard followed
    from another site): its shell holds no data and a GET of it changes nothing."""
    headers = request.headers
    return (
        request.method == "GET"
        and headers.get("Sec-Fetch-Mode", "").strip().lower() == "navigate"
        and headers.get("Sec-Fetch-Dest", "").strip().lower() == "document"
        and _public(request)
    )


GUARD_HEADERS = ("Host", "Origin", "Sec-Fetch-Site")
"""Headers the guards judge a request by: one of each at most (two could be read two ways)."""


def _check_origin(request: web.Request) -> None:
    for name in GUARD_HEADERS:
        if len(request.headers.getall(name, [])) > 1:
            raise PermissionDenied(f"a request with more than one {name} header is refused")
    allowed = request.app[CONFIG].allowed_hosts
    host = request.headers.get("Host", "")
    if not host_allowed(host, allowed):
        raise PermissionDenied("non-local Host refused")
    cross_site = request.headers.get("Sec-Fetch-Site", "").strip().lower() == "cross-site"
    if cross_site and not _public_page_opened(request):
        raise PermissionDenied("cross-site request refused")
    origin = request.headers.get("Origin")
    if origin is None:
        return
    if not origin_allowed(origin, host, allowed):
        raise PermissionDenied("cross-origin request refused")
    if _written_without_asking(request, origin, host):
        raise PermissionDenied(
            "a write from another origin must be sent as JSON (Content-Type: application/json)"
        )


@web.middleware
async def token_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With any token configured, every route but /healthz and /readyz needs a bearer token
    whose grant holds the route's scope; the handler then runs under that grant."""
    book = request.app[TOKENS]
    if not book.configured or request.path in TOKEN_EXEMPT or _public(request):
        return await handler(request)
    grant = book.resolve(request.headers.get("Authorization", ""))
    if grant is None:
        raise Unauthenticated("a valid bearer token is required (Authorization: Bearer ...)")
    request[GRANT] = grant
    needed = scope_for(request)
    if needed not in grant.scopes:
        raise PermissionDenied(f"token {grant.name!r} lacks the {needed!r} scope this route needs")
    reset = CURRENT_GRANT.set(grant)
    try:
        return await handler(request)
    finally:
        CURRENT_GRANT.reset(reset)
