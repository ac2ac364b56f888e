"""The extractor service: LLM extraction of raw rows into layers, catch-up, forget."""
