"""Runs the extractor service: python -m services.extractor."""

from services.extractor.server import main
from shared.runtime import run_service

if __name__ == "__main__":
    run_service("extractor", main)
