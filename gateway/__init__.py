"""The REST gateway: HyAtlas v5's /api/v1 routes over the store and search services."""
