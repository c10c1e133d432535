"""The audit trail: every admin action and every failed authentication, one JSON line each.

A line holds the time, the actor's key id (None when the caller had no valid key), the action, the
target key id and the result; never a secret, a digest or a prompt. Lines go to
``<state_dir>/audit.log``, rotated to ``audit.log.1`` above ``gateway.audit_max_bytes`` (so the
trail is bounded at twice that), and are counted in ``serve_app_audit_events_total``. Several
gateway replicas append to the same file: each line is one ``O_APPEND`` write, which POSIX keeps
whole.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger("ray.serve")


class AuditCounter(Protocol):
    """Counts audit events by action and result (``metrics.AuditMetrics``)."""

    def audited(self, *, action: str, result: str) -> None: ...


class Audit:
    """Writes audit lines to ``path`` (None: the metric and the log only)."""

    def __init__(self, path: Path | None, max_bytes: int, metrics: AuditCounter | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def _time(self) -> str:
        t = datetime.now(UTC) if self._clock is None else datetime.fromtimestamp(self._clock(), UTC)
        return t.isoformat(timespec="milliseconds")

    def record(self, action: str, *, actor: str | None, target: str | None, result: str,
               **detail: Any) -> None:
        """One event. ``detail`` holds other facts that are never secret (e.g. a route, a status)."""
        line = {"time": self._time(), "actor": actor, "action": action, "target": target,
                "result": result, **detail}
        if self.metrics is not None:
            self.metrics.audited(action=action, result=result)
        if self.path is None:
            return
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        try:
            with self._lock:
                self._rotate_if_full()
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
        except OSError as exc:  # the audit trail must never fail the request it records
            logger.error("audit line not written: %s", exc.__class__.__name__)

    def _rotate_if_full(self) -> None:
        assert self.path is not None
        try:
            if self.path.stat().st_size < self.max_bytes:
                return
        except FileNotFoundError:
            return
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))

    def lines(self) -> list[dict[str, Any]]:
        """Every line kept (the rotated file first), for tests and the operator's eye."""
        out: list[dict[str, Any]] = []
        if self.path is None:
            return out
        for p in (self.path.with_name(self.path.name + ".1"), self.path):
            if p.exists():
                out += [json.loads(raw) for raw in p.read_text().splitlines() if raw.strip()]
        return out
