"""Live replica counts: how many replicas of each model deployment are running now.

An autoscaled model runs between ``min_replicas`` and ``max_replicas``; a model whose node was lost
or that is being replaced may run fewer than its ``num_replicas``. Admission sizes each model's
capacity and tier shedding by the replicas running now, so it reads them from Ray Serve's public
``serve.status()`` in a background thread, every ``gateway.replicas_refresh_s`` (the request path
only reads a dict). Until the first answer, or while Ray Serve does not answer, the count is
unknown (None) and admission falls back to the configured replicas.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger("ray.serve")

Fetch = Callable[[], Mapping[str, int]]


def serve_status_fetch(deployments: Mapping[str, str]) -> Fetch:
    """A fetch that reads RUNNING replicas per model id from ``serve.status()`` (``deployments``:
    model id -> deployment name) in this replica's own application."""

    def fetch() -> Mapping[str, int]:
        from ray import serve

        app_name = serve.get_replica_context().app_name
        app = serve.status().applications.get(app_name)
        if app is None:
            return {}
        out: dict[str, int] = {}
        for model_id, name in deployments.items():
            d = app.deployments.get(name)
            if d is not None:
                # ReplicaState is a str enum: its members are equal to (and hash as) their names.
                out[model_id] = int(d.replica_states.get("RUNNING", 0))  # type: ignore[call-overload]
        return out

    return fetch


class LiveReplicas:
    """Running replicas per model id, refreshed by a daemon thread (``start``/``stop``)."""

    def __init__(self, fetch: Fetch, refresh_s: float) -> None:
        self._fetch = fetch
        self._refresh_s = refresh_s
        self._counts: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def running(self, model_id: str) -> int | None:
        """Replicas of ``model_id`` running at the last refresh; None while unknown."""
        return self._counts.get(model_id)

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    def refresh(self) -> None:
        """Read the counts once (the thread calls this; tests may too)."""
        try:
            counts = dict(self._fetch())
        except Exception as exc:  # keep the last known counts; admission still works
            logger.warning("replica counts not refreshed: %s", exc.__class__.__name__)
            return
        if counts != self._counts:
            logger.info("running replicas: %s", counts)
            self._counts = counts  # one assignment: readers see the old dict or the new one

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="live-replicas", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self._refresh_s)

    def diagnostics(self) -> dict[str, Any]:
        return {"running_replicas": self.snapshot(), "refresh_s": self._refresh_s}
