"""A caller's grant: which owners and scopes its token reaches, carried from call to call."""

from __future__ import annotations

import contextvars
import json
from collections.abc import Iterable
from dataclasses import dataclass

from shared.errors import InvalidArgument, PermissionDenied

ANY = "*"
SCOPES = ("read", "write", "admin")


def _names(values: Iterable[str]) -> frozenset[str] | None:
    """A set of names; None when "*" is among them (any name)."""
    names = frozenset(values)
    return None if ANY in names else names


def _listed(value: object) -> frozenset[str] | None:
    """The names a grant header lists (null: any); anything but a list of strings is refused
    (a string would be read as names of one character each: "u6" as users u and 6)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise TypeError("a grant's users and agents are lists of names")
    return frozenset(value)


@dataclass(frozen=True)
class Grant:
    """The owners (user and agent ids, None: any) and scopes one token reaches."""

    name: str
    users: frozenset[str] | None = None
    agents: frozenset[str] | None = None
    scopes: frozenset[str] = frozenset(SCOPES)
    audited: bool = True
    """Whether the audit log records `name` as the caller (not for the one HYATLAS_TOKEN)."""

    @classmethod
    def build(
        cls, name: str, users: Iterable[str], agents: Iterable[str], scopes: Iterable[str]
    ) -> Grant:
        """A grant from lists as a tokens file gives them ("*" in a list: any)."""
        return cls(name, _names(users), _names(agents), frozenset(scopes))

    @property
    def unrestricted(self) -> bool:
        """Whether the grant reaches every owner."""
        return self.users is None and self.agents is None

    def check_owner(self, user_id: str, agent_id: str) -> None:
        """Refuses an owner outside the grant (an empty agent_id, every agent, is narrowed to
        the granted ones by the store, not refused)."""
        if self.users is not None and user_id not in self.users:
            raise PermissionDenied(f"token {self.name!r} does not reach user {user_id!r}")
        if agent_id and self.agents is not None and agent_id not in self.agents:
            raise PermissionDenied(f"token {self.name!r} does not reach agent {agent_id!r}")

    def check_everyone(self, what: str) -> None:
        """Refuses an operation on every owner to a grant that reaches only some."""
        if not self.unrestricted:
            raise PermissionDenied(f"token {self.name!r} reaches only some owners: {what} refused")

    def header(self) -> str:
        """The grant as call metadata (scopes stay with the gateway, which checks them)."""
        return json.dumps({
            "name": self.name,
            "audited": self.audited,
            "users": None if self.users is None else sorted(self.users),
            "agents": None if self.agents is None else sorted(self.agents),
        })

    @classmethod
    def from_header(cls, value: str) -> Grant:
        """The grant a call's metadata carries."""
        try:
            data = json.loads(value)
            return cls(
                str(data["name"]),
                _listed(data["users"]),
                _listed(data["agents"]),
                audited=bool(data["audited"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument("malformed grant in call metadata") from exc


CURRENT_GRANT: contextvars.ContextVar[Grant | None] = contextvars.ContextVar(
    "hyatlas_grant", default=None
)
"""The grant of the call being served: set by the gateway's token check and by the gRPC server
interceptor, sent on by every client call made while it is set. None: the services' own work."""


def current_grant() -> Grant | None:
    """The grant of the call being served, None for a service's own work."""
    return CURRENT_GRANT.get()


def reaches_everyone() -> bool:
    """Whether the call being served may see or act on every owner: its grant reaches them all,
    or it is a service's own work (no grant)."""
    grant = current_grant()
    return grant is None or grant.unrestricted


def check_everyone(what: str) -> None:
    """Refuses `what` (an operation on, or figures of, every owner) to a call whose grant
    reaches only some owners."""
    grant = current_grant()
    if grant is not None:
        grant.check_everyone(what)


def service_context() -> contextvars.Context:
    """A copy of the current context without the caller's grant: for background work a call
    starts that serves the owner, not the caller (an alias group's Now page)."""
    context = contextvars.copy_context()
    context.run(CURRENT_GRANT.set, None)
    return context
