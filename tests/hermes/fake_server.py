"""A stand-in for `make run` in auto-start tests: records its environment and what it is sent.

Usage: fake_server.py OUT_DIR. Answers every route on $HYATLAS_GO_HOST:$HYATLAS_GO_PORT; like a
real stack starting up, it is alive at once but /readyz says 503 to its first NOT_READY_POLLS polls.
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

OUT = Path(sys.argv[1])
NOT_READY_POLLS = 3


class Handler(BaseHTTPRequestHandler):
    readyz_polls = 0

    def _reply(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path != "/readyz":
            self._reply({"status": "ok"})
            return
        Handler.readyz_polls += 1
        with (OUT / "readyz.txt").open("a") as log:
            log.write(f"{Handler.readyz_polls}\n")
        ready = Handler.readyz_polls > NOT_READY_POLLS
        self._reply({"status": "ready" if ready else "not_ready", "ready": ready,
                     "services": {}}, 200 if ready else 503)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with (OUT / "posts.jsonl").open("a") as log:
            log.write(json.dumps({"path": self.path, "body": json.loads(body or b"{}")}) + "\n")
        self._reply({"ok": True})

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    with (OUT / "starts.txt").open("a") as starts:
        starts.write(f"{os.getpid()}\n")
    (OUT / "env.json").write_text(json.dumps(dict(os.environ)))
    host = os.environ.get("HYATLAS_GO_HOST", "127.0.0.1")
    port = int(os.environ["HYATLAS_GO_PORT"])
    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main()
