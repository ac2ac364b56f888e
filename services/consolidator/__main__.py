"""Runs the consolidator service: python -m services.consolidator."""

from services.consolidator.server import main
from shared.runtime import run_service

if __name__ == "__main__":
    run_service("consolidator", main)
