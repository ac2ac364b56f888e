"""The consolidator service: the ultra slow path."""
