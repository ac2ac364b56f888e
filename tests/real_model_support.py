"""A real local model for tests: llama-cpp-python's server on SmolLM2-135M, from `make llm-venv`."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support import ROOT, free_port, http_ok

LLM_PYTHON = ROOT / ".venv-llm" / "bin" / "python"
GGUF = Path.home() / ".cache" / "hyatlas" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def ensure_llm_venv() -> None:
    """Runs `make llm-venv` (a no-op once built); raises with make's output when it fails."""
    try:
        done = subprocess.run(
            ["make", "--no-print-directory", "llm-venv"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
    except OSError as exc:
        raise RuntimeError(f"make llm-venv could not run: {exc}") from exc
    if done.returncode != 0 or not LLM_PYTHON.exists() or not GGUF.exists():
        raise RuntimeError(f"make llm-venv failed ({done.returncode}):\n{done.stdout[-8000:]}")


@dataclass
class LlamaServer:
    """A running llama-cpp-python server: its OpenAI base URL and the model id it reports."""

    base_url: str
    model: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def logs(self) -> str:
        """What the server printed so far."""
        return self.log_path.read_text(errors="replace")[-8000:]


@contextlib.contextmanager
def running_llama_server(log_path: Path, timeout_s: float = 120.0) -> Iterator[LlamaServer]:
    """Serves the GGUF on a free loopback port until the block ends."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    # Loaded without mmap: with mmap, page reclaim on a busy machine made generation ~50x slower.
    flags = {
        "--model": str(GGUF),
        "--host": "127.0.0.1",
        "--port": str(port),
        "--use_mmap": "false",
        "--n_ctx": "2048",
    }
    command = [str(LLM_PYTHON), "-m", "llama_cpp.server", *(x for kv in flags.items() for x in kv)]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not http_ok(f"{base_url}/models"):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"llama server exited {proc.returncode}:\n{log_path.read_text()[-8000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"llama server not ready in {timeout_s}s:\n{log_path.read_text()[-8000:]}"
                )
            time.sleep(0.1)
        with urllib.request.urlopen(f"{base_url}/models", timeout=5) as reply:
            model = json.load(reply)["data"][0]["id"]
        yield LlamaServer(base_url, model, proc, log_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
