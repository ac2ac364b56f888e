"""Whether the server answers: recall back-off after a failure, one warning per outage."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .client import ClientError, HttpError, HyAtlasClient, NotHyAtlas

log = logging.getLogger("hyatlas")

START_HINT = "start it with `hermes hyatlas start` (or set auto_start: true)"
"""What a user can do when the gateway does not answer."""


def problem_text(exc: ClientError, server_url: str) -> str:
    """A failure in words a user can act on."""
    if isinstance(exc, HttpError) and exc.status in (401, 403):
        return (f"HyAtlas memory at {server_url} refused the plugin's token (HTTP {exc.status}); "
                "set HYATLAS_TOKEN in $HERMES_HOME/.env to the server's token")
    if isinstance(exc, NotHyAtlas):
        return f"something other than HyAtlas memory answers at {server_url}: {exc}"
    if isinstance(exc, HttpError) and not exc.from_gateway:
        return (f"something other than HyAtlas memory answers at {server_url} "
                f"(HTTP {exc.status}: {exc.message}); check server_url (hyatlas.json, "
                f"HYATLAS_SERVER_URL), or {START_HINT}")
    if isinstance(exc, HttpError):
        return f"HyAtlas memory at {server_url} is not ready: {exc.message}"
    return f"HyAtlas memory is unreachable at {server_url}; {START_HINT}"


class ServerHealth:
    """Trips after a failed or too slow call: recall is then not waited on for backoff_s.

    The first failure of an outage goes to `warn` (Hermes's warning callback, else the log); the
    next timely success clears the state, so the next outage warns again.
    """

    def __init__(self, backoff_s: float, warn: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._backoff_s = backoff_s
        self._warn = warn
        self._clock = clock
        self._lock = threading.Lock()
        self._skip_until = 0.0
        self._warned = False

    def backing_off(self) -> bool:
        """Whether a turn should not wait for recall now."""
        with self._lock:
            return self._clock() < self._skip_until

    def failed(self, message: str, *, warn: bool = True, wrap: bool = True) -> None:
        """Starts a back-off; warns the user once per outage (with warn, else only logs); wrap
        adds what an outage means for turns."""
        with self._lock:
            self._skip_until = self._clock() + self._backoff_s
            first = warn and not self._warned
            self._warned = self._warned or warn
        if not first:
            log.debug("hyatlas: %s", message)
            return
        text = (f"{message}. Turns will not wait for memory recall for a while; new turns wait "
                "in the local queue." if wrap else f"{message}.")
        log.warning("%s", text)
        if self._warn is not None:
            try:
                self._warn(text)
            except Exception:  # Hermes's callback must never break the plugin's thread
                log.exception("hyatlas: the warning callback failed")

    def recovered(self) -> None:
        """The server answered in time: turns wait for recall again."""
        with self._lock:
            self._skip_until = 0.0
            self._warned = False

    def check(self, client: HyAtlasClient, timeout_s: float) -> bool:
        """Asks the gateway for its status once (an answer that is not a gateway's status counts
        as a failure); records the outcome."""
        try:
            client.status(timeout_s=timeout_s)
        except ClientError as exc:
            self.failed(problem_text(exc, client.base_url))
            return False
        self.recovered()
        return True
