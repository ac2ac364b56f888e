"""Starting and stopping the HyAtlas server for Hermes: allowlisted env, pid file and lock."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .client import ClientError, HyAtlasClient
from .settings import PluginSettings, private_file, state_dir

log = logging.getLogger("hyatlas.lifecycle")

OS_ESSENTIALS = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM",
    "TMPDIR", "TMP", "TEMP", "SYSTEMROOT", "COMSPEC", "PATHEXT", "WINDIR",
})
"""Variables a server process needs from the OS; everything else of the agent stays behind."""

WITHHELD = frozenset({"HYATLAS_LLM_KEY"})
"""HYATLAS_* variables never put in a spawned environment (the key goes by POST instead)."""


def allowed_name(name: str) -> bool:
    """Whether a variable may reach an auto-started server."""
    if name in WITHHELD:
        return False
    return name in OS_ESSENTIALS or name.startswith(("LC_", "HYATLAS_"))


def server_environment(settings: PluginSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """The allowlisted environment for the server, plus the plugin's non-secret settings."""
    env = {k: v for k, v in environ.items() if allowed_name(k)}
    parsed = urllib.parse.urlsplit(settings.server_url)
    if parsed.hostname:
        env["HYATLAS_GO_HOST"] = parsed.hostname
    if parsed.port:
        env["HYATLAS_GO_PORT"] = str(parsed.port)
    for value, name in (
        (settings.data_dir, "HYATLAS_GO_DATA"),
        (settings.mode, "HYATLAS_MODE"),
        (settings.sync, "HYATLAS_SYNC_EXTRACT"),
        (settings.llm_base, "HYATLAS_LLM_BASE"),
        (settings.llm_model, "HYATLAS_LLM_MODEL"),
    ):
        if value:
            env[name] = value
    return env


@dataclass
class StartResult:
    """What ensure_running did."""

    started: bool
    """True when this call spawned the server."""
    pid: int | None
    """The server's pid from the pid file, if any."""
    ready: bool
    """Whether the gateway said at the end that every backing service answers."""
    message: str


class ServerLauncher:
    """Starts the server once across every agent sharing a HERMES_HOME, and stops it on request."""

    def __init__(
        self,
        settings: PluginSettings,
        client: HyAtlasClient,
        hermes_home: str | Path,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.dir = state_dir(hermes_home)
        self.pid_path = self.dir / "server.pid"
        self.lock_path = self.dir / "server.lock"
        self.log_path = self.dir / "server.log"
        self._environ = os.environ if environ is None else environ

    @contextlib.contextmanager
    def _locked(self, timeout_s: float) -> Iterator[bool]:
        handle = private_file(self.lock_path).open("a")
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        yield False
                        return
                    time.sleep(0.1)
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        finally:
            handle.close()

    def read_pid(self) -> int | None:
        """The server's pid from the pid file, if that very process is still running.

        The file holds the pid and the process's start time: once the server is gone, its pid
        can be reused by an unrelated process, which must be neither trusted nor killed.
        """
        try:
            pid_text, started = self.pid_path.read_text().split(maxsplit=1)
            pid = int(pid_text)
        except (FileNotFoundError, ValueError):
            return None
        return pid if process_start(pid) == started.strip() else None

    def ensure_running(self) -> StartResult:
        """Starts the server if the gateway does not answer; waits until it is ready."""
        if self.client.ready():
            return StartResult(False, self.read_pid(), True, "server ready")
        wait_s = self.settings.start_timeout_s
        with self._locked(wait_s + 5.0) as got_lock:
            if not got_lock:
                return StartResult(False, self.read_pid(), self.client.ready(),
                                   "another agent is starting the server")
            pid = self.read_pid()
            started = False
            # A gateway that is alive but not ready is a server still starting: wait for it.
            if pid is None and not self.client.healthy():
                pid = self._spawn()
                started = True
            ready = self._wait_ready(pid, wait_s)
        if ready:
            self._hand_over_key()
            return StartResult(started, pid, True, f"server ready (pid {pid})")
        return StartResult(started, pid, False,
                           f"server not ready within {wait_s:g}s; see {self.log_path}")

    def _spawn(self) -> int:
        argv = self.settings.command_argv()
        if not argv:
            raise ClientError("server_command is empty")
        cwd = self.settings.server_cwd or None
        env = server_environment(self.settings, self._environ)
        with private_file(self.log_path).open("ab") as logfile:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started = process_start(proc.pid) or "exited"
        private_file(self.pid_path).write_text(f"{proc.pid} {started}\n")
        log.info("hyatlas server started: %s (pid %d)", argv, proc.pid)
        return proc.pid

    def _wait_ready(self, pid: int | None, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.client.ready():
                return True
            if pid is not None and not _alive(pid):
                log.warning("hyatlas server exited during start; see %s", self.log_path)
                self.pid_path.unlink(missing_ok=True)
                return False
            time.sleep(0.2)
        return False

    def _hand_over_key(self) -> None:
        key = self.settings.llm_key
        if not key:
            return
        try:
            self.client.set_llm_key(key)
        except ClientError as exc:
            log.warning("could not hand the LLM key to the server: %s", exc)

    def stop(self, grace_s: float = 20.0) -> str:
        """Flushes and stops the server this plugin started (pid file); says what happened."""
        pid = self.read_pid()
        if pid is None:
            self.pid_path.unlink(missing_ok=True)
            return "no server started by the plugin is running"
        with contextlib.suppress(ClientError):
            self.client.flush()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.read_pid() == pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.pid_path.unlink(missing_ok=True)
        return f"server stopped (pid {pid})"


def process_start(pid: int) -> str | None:
    """When process pid started, in the OS's words; None when no such process runs."""
    if Path("/proc/self/stat").exists():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        # Field 22, starttime; field 2, the command name, may hold spaces and ")".
        return stat.rsplit(")", 1)[1].split()[19]
    try:  # no /proc (macOS, the BSDs)
        done = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True,
                              text=True, check=False)
    except OSError:
        return None
    return " ".join(done.stdout.split()) or None


def _alive(pid: int) -> bool:
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        finished = 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return finished == 0
