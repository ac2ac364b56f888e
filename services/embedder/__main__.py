"""Runs the embedder service: `python -m services.embedder`."""

from services.embedder.server import main
from shared.runtime import run_service

if __name__ == "__main__":
    run_service("embedder", main)
