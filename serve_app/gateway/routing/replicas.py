"""The gateway's one reader of Ray Serve's status: running replicas per model, where each one
serves (its endpoint, from the application's registry), and DELETING.

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

The same read takes the endpoint registry's table (``runtime.registry``) and keeps, per model, the
endpoints of the replicas that Ray Serve reports RUNNING: those are the replicas the gateway sends
requests to (``routing.direct``). A replica that starts gets traffic from the next refresh on; one
that Ray Serve stops (STOPPING) gets none from the next refresh on, and refuses any that reaches it
meanwhile (the gateway then tries another: nothing ran).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("ray.serve")
READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Status:
    """One reading of Ray Serve's status for this gateway's application."""

    running: Mapping[str, int] = field(default_factory=dict)  # model id -> RUNNING replicas
    deleting: bool = False  # the app is DELETING: the gateway drains (and never undrains)
    # model id -> RUNNING replica id -> (host, port) of its endpoint, when it has registered one;
    # None when the registry could not be read (the last endpoints are kept)
    endpoints: Mapping[str, Mapping[str, Address]] | None = None
    token: str = ""  # the application's token, which model replicas check (runtime.registry)


Fetch = Callable[[], Status]
Address = tuple[str, int]


def serve_status_fetch(deployments: Mapping[str, str]) -> Fetch:
    """A fetch that reads Ray Serve's details for this replica's own application: RUNNING replicas
    per model id (``deployments``: model id -> deployment name), and whether it is DELETING."""

    actor: list[Any] = []  # the registry's handle, looked up once

    def fetch() -> Status:
        import ray
        from ray import serve
        from ray.serve.context import _get_global_client  # what serve.status() reads

        from serve_app.runtime.registry import registry

        # The replica's context first: outside a replica it raises, before _get_global_client
        # would start a Ray cluster of its own (ray.init) to look for a controller.
        app_name = serve.get_replica_context().app_name
        client = _get_global_client(raise_if_no_controller_running=False)
        if client is None:
            return Status()
        details = client.get_serve_details()
        try:
            if not actor:
                actor.append(registry(app_name))
            token, table = ray.get(actor[0].snapshot.remote(), timeout=READ_TIMEOUT_S)
        except Exception as exc:  # the replica counts still count; the endpoints stay as they were
            logger.warning("endpoint registry not read: %s", exc.__class__.__name__)
            actor.clear()  # a lost registry: look it up (or make it) again next time
            return status_of(details, app_name, deployments)
        return status_of(details, app_name, deployments, table, token)

    return fetch


def status_of(details: Mapping[str, Any], app_name: str, deployments: Mapping[str, str],
              table: Mapping[str, tuple[str, str, int]] | None = None, token: str = "") -> Status:
    """One application's status from the controller's instance details (``get_serve_details``:
    the JSON-shaped dict behind ``serve.status()``), with the endpoints of its RUNNING replicas
    from the registry's ``table`` (replica id -> model id, host, port; None: not read)."""
    app = (details.get("applications") or {}).get(app_name)
    if app is None:
        # Not listed (a controller that is recovering may answer with no applications): no news.
        # A deletion shows as DELETING for as long as this replica lives (its drain).
        return Status()
    running: dict[str, int] = {}
    endpoints: dict[str, dict[str, Address]] = {}
    for model_id, name in deployments.items():
        d = (app.get("deployments") or {}).get(name)
        if d is not None:
            ids = [r.get("replica_id") for r in d.get("replicas") or () if r.get("state") == "RUNNING"]
            running[model_id] = len(ids)
            endpoints[model_id] = {
                rid: (entry[1], entry[2]) for rid in ids
                if isinstance(rid, str) and (entry := (table or {}).get(rid)) and entry[0] == model_id
            }
    return Status(running, app.get("status") == "DELETING",
                  endpoints if table is not None else None, token)


class LiveReplicas:
    """The last status read, refreshed every ``refresh_s`` by a daemon thread (``start``/``stop``)."""

    def __init__(self, fetch: Fetch, refresh_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self.refresh_s = refresh_s
        self._clock = clock
        self._counts: dict[str, int] = {}
        self._endpoints: Mapping[str, Mapping[str, Address]] = {}
        self.token = ""
        self.version = 0  # bumped at each refresh that read a status
        # When a refresh first saw the app deleting; it never goes back.
        self.deleting_since: float | None = None
        self._stop = threading.Event()
        self._poked = threading.Event()  # refresh now, not at the end of the interval
        self._thread: threading.Thread | None = None

    def running(self, model_id: str) -> int | None:
        """Replicas of ``model_id`` running at the last refresh; None while unknown."""
        return self._counts.get(model_id)

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)

    def endpoints(self, model_id: str) -> Mapping[str, Address]:
        """The endpoints of ``model_id``'s RUNNING replicas at the last refresh, by replica id."""
        return self._endpoints.get(model_id) or {}

    def refresh(self) -> None:
        """Read the status once (the thread calls this; tests may too)."""
        try:
            status = self._fetch()
        except Exception as exc:  # keep the last known status; admission still works
            logger.warning("Ray Serve's status not refreshed: %s", exc.__class__.__name__)
            return
        if status.endpoints is not None:
            self._endpoints = status.endpoints  # one assignment each, as below
        if status.token:
            self.token = status.token
        self.version += 1
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
        self._poked.set()

    def poke(self) -> None:
        """Refresh as soon as the thread can (a request found no endpoint for its model): a
        replica that just became RUNNING gets traffic at once, not up to ``refresh_s`` later."""
        self._poked.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._poked.wait(self.refresh_s)
            self._poked.clear()

    def diagnostics(self) -> dict[str, Any]:
        return {"running_replicas": self.snapshot(), "refresh_s": self.refresh_s,
                "deleting": self.deleting_since is not None,
                "endpoints": {m: {r: f"{h}:{p}" for r, (h, p) in e.items()}
                              for m, e in self._endpoints.items()}}
