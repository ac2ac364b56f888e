"""The HyAtlas services, one package per process."""
