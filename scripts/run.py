"""`make run`: every service under supervisord, and one line once the whole stack is ready."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import xmlrpc.client
from pathlib import Path

from supervisor.xmlrpc import SupervisorTransport

from shared.addresses import endpoints
from shared.errors import ConfigError
from shared.runtime import CANNOT_START
from shared.settings import MODE_SERVICES, SERVICES, Settings, read_int

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "supervisord.conf"
POLL_S = 0.25


def supervisor_env(settings: Settings) -> dict[str, str]:
    """This environment with the data and run directories resolved, supervisord's own dir, the
    number of store processes and which services the mode starts."""
    env = dict(os.environ)
    env["HYATLAS_GO_DATA"] = str(settings.data_dir)
    env["HYATLAS_RUN_DIR"] = str(settings.run_dir)
    env["HYATLAS_SUPERVISOR_DIR"] = str(settings.run_dir / "supervisor")
    env |= store_replicas(env, settings)
    env |= started_services(settings.mode)
    return env


def started_services(mode: str) -> dict[str, str]:
    """HYATLAS_START_<SERVICE> (true or false), which supervisord reads as the autostart of the
    services only some modes run: lite starts neither the extractor nor the consolidator."""
    runs = MODE_SERVICES[mode]
    return {
        f"HYATLAS_START_{name.upper()}": "true" if name in runs else "false"
        for name in SERVICES
        if name not in MODE_SERVICES["lite"]
    }


def store_replicas(env: dict[str, str], settings: Settings) -> dict[str, str]:
    """HYATLAS_STORE_REPLICAS (1): how many store processes supervisord starts. Several share
    the PostgreSQL database of HYATLAS_STORE_DSN; replica i serves on entry i of
    HYATLAS_STORE_ADDR, which unset lists one unix socket per replica in the run dir."""
    count = read_int(env, "HYATLAS_STORE_REPLICAS", 1, 1, 64)
    found = {"HYATLAS_STORE_REPLICAS": str(count)}
    if count == 1:
        return found
    if not env.get("HYATLAS_STORE_DSN", "").strip():
        raise ConfigError(
            f"HYATLAS_STORE_REPLICAS={count} needs HYATLAS_STORE_DSN: replicas share one "
            "PostgreSQL database (a SQLite store has one writer)"
        )
    if not env.get("HYATLAS_STORE_ADDR", "").strip():
        sockets = (f"unix:{settings.run_dir / f'store-{i}.sock'}" for i in range(count))
        found["HYATLAS_STORE_ADDR"] = ",".join(sockets)
    elif len(endpoints(settings.address("store"))) != count:
        raise ConfigError(
            f"HYATLAS_STORE_ADDR={settings.address('store')!r} must list "
            f"HYATLAS_STORE_REPLICAS={count} endpoints, one per replica"
        )
    return found


def readyz_url(settings: Settings) -> str:
    """Where this machine reaches the gateway's readiness route."""
    host = settings.http_host
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.http_port}/readyz"


def is_ready(url: str) -> bool:
    """Whether the gateway answers that every backing service is serving."""
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(json.load(reply).get("ready"))
    except (OSError, ValueError):  # not listening yet, 503 while starting, or a half answer
        return False


def gave_up(supervisor_dir: Path) -> list[str]:
    """The programs that cannot start: exited with CANNOT_START, or given up by supervisord
    (FATAL: each start ended before it had lived startsecs); none while supervisord does not
    answer yet."""
    transport = SupervisorTransport(serverurl=f"unix://{supervisor_dir / 'supervisor.sock'}")
    proxy = xmlrpc.client.ServerProxy("http://localhost", transport=transport)
    try:
        processes = proxy.supervisor.getAllProcessInfo()
    except (OSError, xmlrpc.client.Error):
        return []
    return [
        p["name"] if p["group"] == p["name"] else f"{p['group']}:{p['name']}"
        for p in processes
        if p["statename"] == "FATAL"
        or (p["statename"] == "EXITED" and p["exitstatus"] == CANNOT_START)
    ]


def wait_until_ready(proc: subprocess.Popen[bytes], url: str, supervisor_dir: Path) -> bool:
    """Waits for the gateway to say every service is ready; False when supervisord exited or
    gave a service up (a bad setting only that service reads stops it at every start)."""
    while proc.poll() is None and not is_ready(url):
        if failed := gave_up(supervisor_dir):
            print(f"hyatlas: {', '.join(failed)} could not start (its lines above say why): "
                  "stopping", file=sys.stderr, flush=True)
            return False
        time.sleep(POLL_S)
    return proc.poll() is None


def main() -> int:
    """Runs supervisord until it exits; SIGINT and SIGTERM stop it (and every service) cleanly."""
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        print(f"hyatlas: {exc}", file=sys.stderr)
        return 2
    try:
        env = supervisor_env(settings)
    except ConfigError as exc:
        print(f"hyatlas: {exc}", file=sys.stderr)
        return 2
    for folder in (settings.data_dir, settings.run_dir, Path(env["HYATLAS_SUPERVISOR_DIR"])):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    supervisord = Path(sys.executable).parent / "supervisord"
    proc = subprocess.Popen([str(supervisord), "-c", str(CONFIG), "-n"], cwd=ROOT, env=env)

    def stop(signum: int, _frame: object) -> None:
        proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    url = readyz_url(settings)
    # With HYATLAS_GO_PORT=0 the gateway picks its port and only its log says which.
    if not settings.http_port:
        return proc.wait()
    if wait_until_ready(proc, url, Path(env["HYATLAS_SUPERVISOR_DIR"])):
        print(f"hyatlas: ready on {url.removesuffix('/readyz')} (mode {settings.mode}, "
              f"data in {settings.data_dir})", flush=True)
    elif proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        return 2
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
