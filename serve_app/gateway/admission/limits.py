"""Rate limits (RPM, TPM) and concurrency caps as admission sees them: a ``Charge`` against a
counter, the ``Verdict`` of charging several at once, and the clock they are charged at.

The counters and the GCRA that fills and drains them live in ``state/limits.py`` (in memory, or in
Redis when several gateway replicas share them); ``state.open_state`` picks the backend.
"""

from __future__ import annotations

import time

from serve_app.state.limits import WINDOW_S, Charge, LimitBackend, Verdict

__all__ = ["WINDOW_S", "Charge", "LimitBackend", "Verdict", "clock"]


def clock() -> float:
    return time.time()
