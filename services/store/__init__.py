"""The store service: the only process that touches the data directory."""
