"""The audit trail's file: one JSON line per event, appended to ``<gateway.state.dir>/audit.log`` and
rotated to ``audit.log.1`` above ``gateway.accounting.audit_max_bytes`` (so the trail is bounded at twice
that). Several gateway replicas append to the same file: each line is one ``O_APPEND`` write,
which POSIX keeps whole. What a line holds is ``gateway/accounting/audit.py``'s business.

A line is written synchronously: the callers (authentication, the admin routes) are synchronous,
a line is one small ``write`` into the page cache, and a line written before the answer is sent is
the trail's promise.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

AUDIT_FILE = "audit.log"


class AuditFile:
    """Appends JSON lines to ``path``, rotating it to ``<path>.1`` once it reaches ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, line: dict[str, Any]) -> None:
        """One line; raises ``OSError`` if it could not be written."""
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._rotate_if_full()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    def _rotate_if_full(self) -> None:
        try:
            if self.path.stat().st_size < self.max_bytes:
                return
        except FileNotFoundError:
            return
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))

    def lines(self) -> list[dict[str, Any]]:
        """Every line kept (the rotated file first), for tests and the operator's eye."""
        out: list[dict[str, Any]] = []
        for p in (self.path.with_name(self.path.name + ".1"), self.path):
            if p.exists():
                out += [json.loads(raw) for raw in p.read_text().splitlines() if raw.strip()]
        return out
