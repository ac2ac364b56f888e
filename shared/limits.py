"""The size limits on what a client sends: one place, read by the gateway, the store and the
embedder."""

from __future__ import annotations

from collections.abc import Sequence

from shared.errors import InvalidArgument, TooLarge

MAX_TEXT_CHARS = 100_000
"""A memory's text, a search query, a value to forget: longer is a 413."""

EMBED_HEADROOM_CHARS = 1_000
"""What the store or search may add to a text at the limit before embedding it (a context key
carries up to 400 characters of each neighbouring turn; a query gets the model's prefix)."""

MAX_EMBED_CHARS = MAX_TEXT_CHARS + EMBED_HEADROOM_CHARS
"""The longest text the embedder accepts."""

MAX_NAME_CHARS = 256
"""Any other string parameter: user_id, agent_id, session_id, ids, layer and reader names."""

MAX_IDEMPOTENCY_KEY_CHARS = 255
"""An Idempotency-Key: printable ASCII up to this length."""

MAX_KEY_CHARS = 512
"""A state key (a prefix and up to two names): longer is refused. So many characters of UTF-8
fit one PostgreSQL index entry (a third of a page), as every name column beside another does."""

MAX_METADATA_BYTES = 64 * 1024
"""A memory's metadata object, as compact UTF-8 JSON: larger is a 413."""

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The largest gRPC message a service sends or takes."""

TRANSFER_BUDGET_BYTES = 16 * 1024 * 1024
"""What the JSONL lines of one export page or one import batch add up to at most (besides at
most so many lines): well under MAX_MESSAGE_BYTES, as a call carries vectors and framing too."""

MAX_TRANSFER_LINE_BYTES = 48 * 1024 * 1024
"""One JSONL line alone in an export page or import batch (a memory with a long history can be
larger than TRANSFER_BUDGET_BYTES): a larger line cannot go in one call, and is a 413."""

MAX_JSON_DEPTH = 32
"""How deeply a request body's arrays and objects may nest."""

FIRST_TIME_S = 0.0
"""The earliest time a client may send: 1970-01-01T00:00:00Z (unix seconds)."""

END_OF_CALENDAR_S = 253402300800.0
"""10000-01-01T00:00:00Z: every time a client sends or an import carries lies before it."""

MAX_UTC_OFFSET_MINUTES = 24 * 60 - 1
"""The largest UTC offset a client may give a time, east or west: under a day, as an ISO 8601
time writes it (+23:59). The clocks in use run from -12:00 to +14:00."""

START_OF_CALENDAR_S = -62135596800.0
"""0001-01-01T00:00:00Z: an imported time may reach back this far (an export of a version that
took dates before 1970 still imports)."""


MAX_COUNT = 2**31 - 1
"""A row's counts (times seen, used, tried) lie in 0..this: they travel as int32, and
PostgreSQL keeps them so."""


def check_utc_offset(what: str, minutes: object) -> int:
    """A UTC offset in whole minutes, under a day either way, else a 400."""
    if (
        isinstance(minutes, bool)
        or not isinstance(minutes, int)
        or not -MAX_UTC_OFFSET_MINUTES <= minutes <= MAX_UTC_OFFSET_MINUTES
    ):
        raise InvalidArgument(
            f"{what} {minutes} is not between -{MAX_UTC_OFFSET_MINUTES} and "
            f"{MAX_UTC_OFFSET_MINUTES} minutes (under a day)"
        )
    return minutes


def check_count(what: str, value: object) -> int:
    """A count a row keeps (0..MAX_COUNT), else a 400."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise InvalidArgument(f"{what} must be a count: a whole number from 0 to 2^31 - 1")
    return value


def check_name(what: str, value: str) -> str:
    """A name (user_id, agent_id, session_id, an id) within MAX_NAME_CHARS and without a NUL
    character (check_no_nul), else a 400."""
    if len(value) > MAX_NAME_CHARS:
        raise InvalidArgument(f"{what} has {len(value):,} characters; at most {MAX_NAME_CHARS}")
    return check_no_nul(what, value)


def check_identity(what: str, value: str) -> str:
    """A name a REST call gives to reach a row (its id, user_id, agent_id, session_id):
    check_name's rules, and no whitespace around it. The API trims every name it is given, so
    it could never reach a row stored under " alice " or with the id " x "."""
    if value != value.strip():
        raise InvalidArgument(
            f"{what} {value[:MAX_NAME_CHARS]!r} has whitespace around it: the API trims the "
            "names it is given, so it could never name this one"
        )
    return check_name(what, value)


def check_id_list(what: str, ids: Sequence[str], most: int) -> None:
    """A list of ids a call names: none blank and at most `most` of them (refused, never cut),
    else a 400 naming the first blank one."""
    blank = next((i for i, one in enumerate(ids) if not one.strip()), None)
    if blank is not None:
        raise InvalidArgument(f"{what}[{blank}] is blank")
    if len(ids) > most:
        raise InvalidArgument(
            f"{what} holds {len(ids):,} ids; at most {most:,} a call, call again for the rest"
        )


def check_text(what: str, value: str, most: int = MAX_TEXT_CHARS) -> str:
    """Free text (a memory's text, a query, a reason) within most characters (MAX_TEXT_CHARS
    unless it is longer by rule, as a context key), else a 413, and without a NUL character
    (check_no_nul)."""
    if len(value) > most:
        raise TooLarge(f"{what} has {len(value):,} characters; the limit is {most:,}")
    return check_no_nul(what, value)


def check_no_nul(what: str, value: str) -> str:
    """A string without a NUL character, else a 400: PostgreSQL's text cannot hold one, so
    SQLite is not let keep one either, and a store can move from one backend to the other."""
    if "\x00" in value:
        raise InvalidArgument(f"{what} may not hold a NUL character")
    return value


def check_idempotency_key(key: str) -> str:
    """An Idempotency-Key ("" for none) as a client may send it, else a 400."""
    if len(key) > MAX_IDEMPOTENCY_KEY_CHARS or not (key.isascii() and key.isprintable()):
        raise InvalidArgument(
            f"Idempotency-Key must be up to {MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters"
        )
    return key


def check_key(what: str, key: str) -> str:
    """A state key within MAX_KEY_CHARS, else a 400."""
    if len(key) > MAX_KEY_CHARS:
        raise InvalidArgument(f"{what} has {len(key):,} characters; at most {MAX_KEY_CHARS}")
    return key


def check_reprocess(ids: Sequence[str], most: int, page: int) -> None:
    """A reprocess call: max not negative and at most page rows, ids as check_id_list takes
    them (refused, never cut: one listing of the store gives page rows)."""
    if most < 0:
        raise InvalidArgument("max must not be negative")
    if most > page:
        raise InvalidArgument(f"max is at most {page:,} a call; call again for the rest")
    check_id_list("ids", ids, page)  # as many as max may name, each a row
