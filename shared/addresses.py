"""Service addresses: one endpoint, or a comma-separated list of replicas gRPC balances across."""

from __future__ import annotations

import ipaddress
from pathlib import Path

LOAD_BALANCING = ("grpc.lb_policy_name", "round_robin")
"""Channel option for a list of replicas: each call goes to the next connected endpoint; an
endpoint that drops out is skipped. A single endpoint keeps gRPC's default (pick_first), which
waits through a restart of the one server rather than failing calls while it reconnects."""


def balancing(address: str) -> list[tuple[str, str]]:
    """The channel options that spread an address's calls: LOAD_BALANCING for a list."""
    return [LOAD_BALANCING] if len(endpoints(address)) > 1 else []


def endpoints(address: str) -> list[str]:
    """The endpoints an address names, in order: one, or each entry of a comma-separated list."""
    return [entry.strip() for entry in address.split(",") if entry.strip()]


def is_unix(endpoint: str) -> bool:
    """Whether an endpoint is a unix socket (unix:PATH or unix:///PATH) rather than TCP."""
    return endpoint.startswith("unix:")


def is_loopback_host(host: str) -> bool:
    """Whether a host name or IP literal (no brackets, no port) is this machine's loopback:
    localhost, 127.0.0.0/8 or ::1."""
    if host.lower().removesuffix(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unix_path(endpoint: str) -> Path | None:
    """The socket file of a unix endpoint; None for TCP."""
    if not is_unix(endpoint):
        return None
    path = endpoint.removeprefix("unix:")
    while path.startswith("//"):
        path = path[1:]
    return Path(path)


def channel_target(address: str) -> str:
    """The gRPC target of an address: a single endpoint as it is, a list in the form gRPC's own
    resolvers take for several addresses (unix:P1,P2 / ipv4:H1:P1,H2:P2 / ipv6:[H1]:P1,[H2]:P2).

    ValueError says why a list cannot be one target: an endpoint named twice, unix sockets and
    TCP mixed, a DNS name (it may stand alone, as one endpoint), or IPv4 and IPv6 mixed.
    """
    entries = endpoints(address)
    if len(entries) == 1:
        return entries[0]
    if not entries:
        raise ValueError("names no endpoint")
    twice = sorted({entry for entry in entries if entries.count(entry) > 1})
    if twice:
        # One replica would take twice the calls of each other, and look like two in status.
        raise ValueError(f"names {', '.join(twice)} twice")
    unix = [is_unix(entry) for entry in entries]
    if all(unix):
        return "unix:" + ",".join(str(unix_path(entry)) for entry in entries)
    if any(unix):
        raise ValueError("mixes unix sockets and TCP endpoints")
    families = {_ip_family(entry) for entry in entries}
    if len(families) > 1:
        raise ValueError("mixes IPv4 and IPv6 endpoints")
    return f"{families.pop()}:{','.join(entries)}"


def _ip_family(endpoint: str) -> str:
    """ipv4 or ipv6 for an IP:PORT or [IP]:PORT endpoint; ValueError for anything else."""
    host, colon, port = endpoint.rpartition(":")
    if not colon or not port.isdigit():
        raise ValueError(f"{endpoint!r} in a list must be IP:PORT")
    try:
        ip = ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        raise ValueError(
            f"{endpoint!r} in a list must name an IP address, not a host name (a host name "
            "may stand alone: then every address it resolves to takes calls in turn)"
        ) from None
    if ip.version == 6 and not host.startswith("["):
        raise ValueError(f"{endpoint!r}: write an IPv6 endpoint as [IP]:PORT")
    return f"ipv{ip.version}"
