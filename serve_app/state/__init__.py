"""The state layer: ``open_state(cfg)`` opens every connection (``connections``) and the typed
stores built on them. Nothing else under ``serve_app`` builds a Redis client or a SQLite connection."""
