"""Runs the store service: `python -m services.store`."""

from services.store.server import main
from shared.runtime import run_service

if __name__ == "__main__":
    run_service("store", main)
