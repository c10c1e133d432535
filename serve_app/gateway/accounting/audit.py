"""The audit trail: every admin action and every failed authentication, one JSON line each.

A line holds the time, the actor's key id (None when the caller had no valid key), the action, the
target key id and the result; never a secret, a digest or a prompt. Lines go to the state's audit
file (``state/audit.py``: ``<gateway.state.dir>/audit.log``, rotated above
``gateway.accounting.audit_max_bytes``), and are counted in ``serve_app_audit_events_total``.

Failed authentications of callers with no valid key are sampled: at most
``unauthenticated_per_min`` lines a minute per replica, the rest counted (the metric counts
every one) and summed up in one ``auth_failed_suppressed`` line when the next minute begins. So
anonymous traffic, which costs an attacker nothing, cannot rotate the records of authenticated
actions out of the bounded trail.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

from serve_app.state.audit import AuditFile

logger = logging.getLogger("ray.serve")


class AuditCounter(Protocol):
    """Counts audit events by action and result (``metrics.AuditMetrics``)."""

    def audited(self, *, action: str, result: str) -> None: ...


class Audit:
    """Writes audit lines to ``file`` (None: the metric and the log only)."""

    def __init__(self, file: AuditFile | None, metrics: AuditCounter | None = None,
                 clock: Callable[[], float] | None = None, unauthenticated_per_min: int = 60,
                 ) -> None:
        self.file = file
        self.metrics = metrics
        self._clock = clock
        self.unauthenticated_per_min = unauthenticated_per_min
        self._minute = -1  # the minute the sample counts in, and what it let through / held back
        self._written = self._suppressed = 0

    def _now(self) -> float:
        return time.time() if self._clock is None else self._clock()

    def _sampled_out(self) -> bool:
        """Whether this anonymous failure stays out of the file (a new minute first writes the
        last one's suppressed count)."""
        minute = int(self._now() // 60)
        if minute != self._minute:
            if self._suppressed:
                self._write({"time": self._time(), "actor": None,
                             "action": "auth_failed_suppressed", "target": None,
                             "result": str(self._suppressed)})
            self._minute, self._written, self._suppressed = minute, 0, 0
        if self._written >= self.unauthenticated_per_min:
            self._suppressed += 1
            return True
        self._written += 1
        return False

    def _time(self) -> str:
        return datetime.fromtimestamp(self._now(), UTC).isoformat(timespec="milliseconds")

    def record(self, action: str, *, actor: str | None, target: str | None, result: str,
               **detail: Any) -> None:
        """One event. ``detail`` holds other facts that are never secret (e.g. a route, a status)."""
        line = {"time": self._time(), "actor": actor, "action": action, "target": target,
                "result": result, **detail}
        if self.metrics is not None:
            self.metrics.audited(action=action, result=result)
        if self.file is None:
            return
        if action == "auth_failed" and actor is None and self._sampled_out():
            return
        self._write(line)

    def _write(self, line: dict[str, Any]) -> None:
        assert self.file is not None
        try:
            self.file.append(line)
        except OSError as exc:  # the audit trail must never fail the request it records
            logger.error("audit line not written: %s", exc.__class__.__name__)

    def lines(self) -> list[dict[str, Any]]:
        """Every line kept (the rotated file first), for tests and the operator's eye."""
        return [] if self.file is None else self.file.lines()
