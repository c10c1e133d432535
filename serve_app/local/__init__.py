"""The embedded default's launcher: demo key, local Redis, tiny model, Ray, front door, Prometheus."""

from __future__ import annotations


def say(msg: str) -> None:
    """A progress line of ``serve-app run`` (and of the commands that share its parts)."""
    print(f"[serve-app] {msg}", flush=True)
