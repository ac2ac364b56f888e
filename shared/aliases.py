"""User ids that are one person (HYATLAS_USER_ALIASES): who a scope reaches, whose page is whose."""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import ConfigError


@dataclass(frozen=True)
class Aliases:
    """Groups of user ids that are the same person."""

    groups: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def parse(cls, raw: str) -> Aliases:
        """Groups split by ';', ids in a group by ',' (a group of one is no group); an id in two
        groups is a ConfigError, as each id is one person."""
        groups: list[tuple[str, ...]] = []
        for chunk in raw.split(";"):
            ids = tuple(dict.fromkeys(part.strip() for part in chunk.split(",") if part.strip()))
            if len(ids) > 1:
                _check_apart(ids, groups)
                groups.append(ids)
        return cls(tuple(groups))

    def group(self, user_id: str) -> tuple[str, ...]:
        """Every user id that is the same person as user_id, user_id first."""
        for group in self.groups:
            if user_id in group:
                return (user_id, *[other for other in group if other != user_id])
        return (user_id,)

    def canonical(self, user_id: str) -> str:
        """The first id of user_id's group (where episodes and Now pages are kept)."""
        for group in self.groups:
            if user_id in group:
                return group[0]
        return user_id


def _check_apart(ids: tuple[str, ...], groups: list[tuple[str, ...]]) -> None:
    for group in groups:
        if shared := [user_id for user_id in ids if user_id in group]:
            raise ConfigError(
                f"HYATLAS_USER_ALIASES lists {shared[0]!r} in two groups ({','.join(group)!r} and "
                f"{','.join(ids)!r}); an id is one person: put the ids of that person in one group"
            )
