"""Warnings and errors reach a replica's log file at once, even in Ray Serve's throughput mode.

Ray Serve writes each replica's log through a ``logging.handlers.MemoryHandler`` of
``RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE`` records (1 by default, 1,000 under
``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``), flushed when full or on an ERROR record. Warnings waited
for 999 other lines, and a replica that was killed left an empty log file. Setting the buffer size
to 1 would cost the throughput mode its point (a write per request line), so ``install`` only
lowers the handlers' flush level to WARNING: info lines stay buffered, warnings and errors are
written at once. ``flush_all`` is called before a replica exits on purpose (``os._exit`` skips
logging's own flush at exit).
"""

from __future__ import annotations

import logging
import logging.handlers
from collections.abc import Iterable

LOGGERS = ("ray.serve", "")


def _memory_handlers(names: Iterable[str]) -> list[logging.handlers.MemoryHandler]:
    found: list[logging.handlers.MemoryHandler] = []
    for name in names:
        for h in logging.getLogger(name).handlers:
            if isinstance(h, logging.handlers.MemoryHandler) and h not in found:
                found.append(h)
    return found


def install(level: int = logging.WARNING, names: Iterable[str] = LOGGERS) -> int:
    """Flush buffered replica logs on ``level`` and above; returns how many handlers changed."""
    handlers = _memory_handlers(names)
    for h in handlers:
        h.flushLevel = min(h.flushLevel, level)
    return len(handlers)


def flush_all(names: Iterable[str] = LOGGERS) -> None:
    for h in _memory_handlers(names):
        try:
            h.flush()
        except Exception:  # noqa: S110 - flushing on the way out must never raise
            pass
