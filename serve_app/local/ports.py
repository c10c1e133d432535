"""The one free-port finder: the launcher's Redis, HAProxy's stats and metrics listeners and
Prometheus, and the test and load harnesses (an exception in tests/unit/test_imports.py) all take
their loopback ports from here."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (the OS picks it; the caller binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
