"""Admin compact_raw: every raw turn keeps only its USER and ASSISTANT messages, each capped."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from services.store.apply import apply_unkeyed
from services.store.core import Core
from services.store.model import RAW, ListQuery, Op, Reach, Update

MESSAGE_CHARS = 4000
TURN_CHARS = 12000
SAMPLES = 5
CHUNK = 200
"""Rows rewritten in one transaction (each new text is embedded inside it)."""
_KEPT_ROLES = ("USER", "ASSISTANT")
_ROLES = (*_KEPT_ROLES, "SYSTEM", "DEVELOPER", "TOOL", "FUNCTION")
"""The roles a transcript's messages start with. Only these: a user's own line such as "TODO:
buy milk" or "NOTE: ..." starts no message, so it is not dropped as one."""
_ROLE = re.compile(rf"^({'|'.join(_ROLES)}):\s?", re.M)


def _cap(text: str, limit: int) -> str:
    """The text cut to limit characters (the last one an ellipsis), as the plugin caps."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def compact_turn(text: str) -> str:
    """A turn with only its USER and ASSISTANT messages, each and the whole capped."""
    starts = list(_ROLE.finditer(text))
    if not starts:
        return _cap(text, TURN_CHARS)
    messages = []
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        if match.group(1) in _KEPT_ROLES:
            body = text[match.end() : end].strip()
            messages.append(f"{match.group(1)}: {_cap(body, MESSAGE_CHARS)}")
    return _cap("\n\n".join(messages), TURN_CHARS) if messages else _cap(text, TURN_CHARS)


@dataclass
class CompactResult:
    """What compact_raw found and changed."""

    dry_run: bool
    rows_checked: int = 0
    rows_changed: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    sample: list[str] = field(default_factory=list)
    rows_rewritten: int = 0


async def compact_raw(core: Core, dry_run: bool, actor: str) -> CompactResult:
    """Caps every raw turn; rewrites them unless dry_run (the audit log keeps the old text).
    A turn edited, retired or deleted since it was read is left as it is now."""
    result = CompactResult(dry_run)
    everyone = Reach(None)
    ops: list[Op] = []
    for row in await core.all_rows(everyone, ListQuery(layers=(RAW,))):
        result.rows_checked += 1
        compacted = compact_turn(row.content)
        result.bytes_before += len(row.content.encode())
        result.bytes_after += len(compacted.encode())
        if compacted != row.content:
            result.rows_changed += 1
            if len(result.sample) < SAMPLES:
                result.sample.append(row.id)
            ops.append(Update(row.id, content=compacted, if_content=row.content))
    if not dry_run:
        for start in range(0, len(ops), CHUNK):
            chunk = ops[start : start + CHUNK]
            written = await apply_unkeyed(core, everyone, chunk, actor, "admin compact_raw")
            result.rows_rewritten += sum(row is not None for row in written)
    return result
