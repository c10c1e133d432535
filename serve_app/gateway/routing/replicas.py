"""The gateway's one reader of Ray Serve's status: running replicas per model, and DELETING.

An autoscaled model runs between ``min_replicas`` and ``max_replicas``; a model whose node was lost
or that is being replaced may run fewer than its ``num_replicas``. Admission sizes each model's
capacity and tier shedding by the replicas running now, the outage guard asks whether a model has
none, and the drain asks whether the app is being deleted. All three read the snapshot that
``LiveReplicas`` keeps: a daemon thread reads Ray Serve's instance details every
``gateway.replicas_refresh_s`` (the request path only reads attributes), as the dict that the
controller sends: ``serve.status()`` builds Ray's pydantic models from that dict, which pickles
each deployment's request router class again, about 40 ms of this process's CPU (with the GIL)
per read, every 2 s, beside the token path (py-spy, issue 27). Until the first answer,
or while Ray Serve does not answer, a count is unknown (None) and admission falls back to the
configured replicas.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Status:
    """One reading of Ray Serve's status for this gateway's application."""

    running: Mapping[str, int] = field(default_factory=dict)  # model id -> RUNNING replicas
    deleting: bool = False  # the app is DELETING: the gateway drains (and never undrains)


Fetch = Callable[[], Status]


def serve_status_fetch(deployments: Mapping[str, str]) -> Fetch:
    """A fetch that reads Ray Serve's details for this replica's own application: RUNNING replicas
    per model id (``deployments``: model id -> deployment name), and whether it is DELETING."""

    def fetch() -> Status:
        from ray import serve
        from ray.serve.context import _get_global_client  # what serve.status() reads

        # The replica's context first: outside a replica it raises, before _get_global_client
        # would start a Ray cluster of its own (ray.init) to look for a controller.
        app_name = serve.get_replica_context().app_name
        client = _get_global_client(raise_if_no_controller_running=False)
        if client is None:
            return Status()
        return status_of(client.get_serve_details(), app_name, deployments)

    return fetch


def status_of(details: Mapping[str, Any], app_name: str, deployments: Mapping[str, str]) -> Status:
    """One application's status from the controller's instance details (``get_serve_details``:
    the JSON-shaped dict behind ``serve.status()``)."""
    app = (details.get("applications") or {}).get(app_name)
    if app is None:
        # Not listed (a controller that is recovering may answer with no applications): no news.
        # A deletion shows as DELETING for as long as this replica lives (its drain).
        return Status()
    running: dict[str, int] = {}
    for model_id, name in deployments.items():
        d = (app.get("deployments") or {}).get(name)
        if d is not None:
            running[model_id] = sum(1 for r in d.get("replicas") or () if r.get("state") == "RUNNING")
    return Status(running, app.get("status") == "DELETING")


class LiveReplicas:
    """The last status read, refreshed every ``refresh_s`` by a daemon thread (``start``/``stop``)."""

    def __init__(self, fetch: Fetch, refresh_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self.refresh_s = refresh_s
        self._clock = clock
        self._counts: dict[str, int] = {}
        # When a refresh first saw the app deleting; it never goes back.
        self.deleting_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def running(self, model_id: str) -> int | None:
        """Replicas of ``model_id`` running at the last refresh; None while unknown."""
        return self._counts.get(model_id)

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    def refresh(self) -> None:
        """Read the status once (the thread calls this; tests may too)."""
        try:
            status = self._fetch()
        except Exception as exc:  # keep the last known status; admission still works
            logger.warning("Ray Serve's status not refreshed: %s", exc.__class__.__name__)
            return
        counts = dict(status.running)
        if counts != self._counts:
            logger.info("running replicas: %s", counts)
            self._counts = counts  # one assignment: readers see the old dict or the new one
        if status.deleting and self.deleting_since is None:
            self.deleting_since = self._clock()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="live-replicas", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.refresh_s)

    def diagnostics(self) -> dict[str, Any]:
        return {"running_replicas": self.snapshot(), "refresh_s": self.refresh_s,
                "deleting": self.deleting_since is not None}
