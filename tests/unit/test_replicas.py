"""Live replica counts: admission capacity and tier shedding follow the replicas running now; the
same reading tells the drain that the app is being deleted."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord, load_app_config
from serve_app.gateway.admission.admission import Admission
from serve_app.gateway.routing.replicas import LiveReplicas, Status, status_of
from serve_app.state.limits import MemoryBackend
from tests.unit.builders import app_config, key_record, model_doc, tier

ROOT = Path(__file__).resolve().parents[2]
PREMIUM = key_record("p", tier="premium")
BATCH = key_record("b", tier="batch")


class Counts:
    """A fetch whose answer the test sets (or makes fail)."""

    def __init__(self, **counts: int) -> None:
        self.counts: Mapping[str, int] = dict(counts)
        self.deleting = False
        self.fail = False
        self.calls = 0

    def __call__(self) -> Status:
        self.calls += 1
        if self.fail:
            raise ConnectionError("controller unreachable")
        return Status(dict(self.counts), self.deleting)


def _cfg(**gateway: Any) -> AppConfig:
    return app_config(
        model_doc(id="tiny",
                  deployment={"autoscaling_config": {"min_replicas": 1, "max_replicas": 2},
                              "max_ongoing_requests": 12, "max_queued_requests": 32},
                  admission={"saturation_requests": 40}),
        tiers={"premium": tier(0, shed_at=1.0), "batch": tier(10, shed_at=0.5)},
        default_tier="premium",
        gateway={"http": {"unavailable_hold_s": 0.3}, "replicas_refresh_s": 0.05, **gateway},
    )


def _admit_many(adm: Admission, key: KeyRecord, n: int) -> list[Any]:
    async def one() -> Any:
        try:
            return await adm.admit(key, ["tiny"], {"max_tokens": 8}, 100)
        except errors.ServeAppError as exc:
            return exc

    async def run() -> list[Any]:
        return [await one() for _ in range(n)]

    return asyncio.run(run())


def test_bounds_follow_the_running_replicas() -> None:
    counts = Counts()
    live = LiveReplicas(counts, 1.0)
    adm = Admission(_cfg(), MemoryBackend(), live)
    # Unknown yet: the configured largest size (max_replicas), as before live counts.
    assert adm.bounds("tiny") == (12 * 2 + 32, 40)
    counts.counts = {"tiny": 1}
    live.refresh()
    assert adm.running("tiny") == 1
    assert adm.bounds("tiny") == (12 * 1 + 32, 20)
    counts.counts = {"tiny": 2}
    live.refresh()
    assert adm.bounds("tiny") == (56, 40)
    # A surge replica during an update adds no lasting capacity: bounded by max_replicas.
    counts.counts = {"tiny": 3}
    live.refresh()
    assert adm.bounds("tiny") == (56, 40)


def test_a_failed_refresh_keeps_the_last_counts() -> None:
    counts = Counts(tiny=1)
    live = LiveReplicas(counts, 1.0)
    live.refresh()
    counts.fail = True
    live.refresh()
    assert live.running("tiny") == 1


def test_with_one_replica_batch_is_shed_at_its_share_and_premium_is_not() -> None:
    live = LiveReplicas(Counts(tiny=1), 1.0)
    live.refresh()
    adm = Admission(_cfg(), MemoryBackend(), live)
    batch = _admit_many(adm, BATCH, 15)
    assert sum(not isinstance(r, Exception) for r in batch) == 10  # 0.5 x 20 at one replica
    assert all(isinstance(r, errors.Shed) for r in batch if isinstance(r, Exception))
    premium = _admit_many(adm, PREMIUM, 40)
    assert sum(not isinstance(r, Exception) for r in premium) == 44 - 10  # up to the capacity
    refused = [r for r in premium if isinstance(r, Exception)]
    assert refused and all(type(r) is errors.Overloaded for r in refused)


def test_a_model_with_no_running_replica_is_admitted_for_the_outage_guard_to_hold() -> None:
    """Admission does not wait or refuse: the one hold is the forwarder's (outage.py), and the
    request waiting in Ray Serve's queue is what asks the autoscaler for a replica."""
    live = LiveReplicas(Counts(tiny=0), 1.0)
    live.refresh()
    adm = Admission(_cfg(), MemoryBackend(), live)
    t0 = time.monotonic()
    [r] = _admit_many(adm, PREMIUM, 1)
    assert r.model_id == "tiny" and time.monotonic() - t0 < 0.25
    assert adm.inflight["tiny"] == 1
    assert adm.bounds("tiny") == (12 + 32, 40 / 2)  # bounded as if one of its two replicas ran


def test_a_fallback_with_a_running_replica_goes_before_a_primary_with_none() -> None:
    cfg = _cfg()
    cfg = cfg.model_copy(update={"models": [*cfg.models, cfg.models[0].model_copy(update={"id": "other"})]})
    live = LiveReplicas(Counts(tiny=0, other=1), 1.0)
    live.refresh()
    adm = Admission(cfg, MemoryBackend(), live)
    ticket = asyncio.run(adm.admit(PREMIUM, ["tiny", "other"], {"max_tokens": 8}, 100))
    assert ticket.model_id == "other"


def test_the_thread_refreshes_and_a_deletion_once_seen_stays() -> None:
    counts = Counts(tiny=0)
    live = LiveReplicas(counts, 0.02)
    live.start()
    try:
        time.sleep(0.1)
        assert live.running("tiny") == 0 and live.deleting_since is None
        counts.counts, counts.deleting = {"tiny": 1}, True
        time.sleep(0.1)
        assert live.running("tiny") == 1 and live.deleting_since is not None
        since = live.deleting_since
        counts.deleting = False
        counts.fail = True  # the controller goes away with the app: nothing changes
        time.sleep(0.1)
        assert live.deleting_since == since and live.running("tiny") == 1
    finally:
        live.stop()
    assert counts.calls >= 3


def test_cluster_cpu_config_is_prod_layout_with_tiny_models() -> None:
    prod = load_app_config(ROOT / "configs/prod.yaml")
    cluster = load_app_config(ROOT / "configs/cluster-cpu.yaml")
    assert list(cluster.tiers) == list(prod.tiers) and cluster.default_tier == prod.default_tier
    assert [t.shed_at < 1.0 for t in cluster.tiers.values()] == [t.shed_at < 1.0 for t in prod.tiers.values()]
    g = cluster.gateway
    assert g.num_replicas == prod.gateway.num_replicas == 2 and g.state.redis_url
    assert g.keys.file == prod.gateway.keys.file  # the mounted Secret
    assert [m.task for m in cluster.models] == [m.task for m in prod.models]
    chat = cluster.models[0]
    assert chat.source == "builtin:tiny-chat" and chat.accelerator.kind == "cpu"
    auto = chat.deployment.autoscaling_config
    assert auto is not None and (auto.min_replicas, auto.max_replicas) == (1, 2)
    # Streams drain on scale-down and updates; an update starts the new replica first.
    for m in cluster.models:
        assert m.deployment.graceful_shutdown_timeout_s >= 120 and m.deployment.max_surge_percent == 100
    assert g.http.drain_timeout_s + 5 >= 120  # app.py: the gateway's graceful_shutdown_timeout_s


def test_gateway_modules_load_no_engine_code() -> None:
    code = ("import sys, serve_app.gateway.deployment, serve_app.gateway.routing.replicas; "
            "print(sorted(m for m in ('vllm', 'torch', 'transformers', 'serve_app.engine') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_status_is_read_from_the_controllers_details_dict() -> None:
    replicas = [{"replica_id": "a", "state": "RUNNING"}, {"replica_id": "b", "state": "STARTING"},
                {"replica_id": "c", "state": "RUNNING"}]
    details = {"applications": {"llm": {"status": "RUNNING", "deployments": {
        "model-tiny-chat": {"status": "HEALTHY", "replicas": replicas},
        "model-embed": {"status": "UPDATING", "replicas": []}}}}}
    deployments = {"tiny-chat": "model-tiny-chat", "embed": "model-embed", "gone": "model-gone"}
    assert status_of(details, "llm", deployments).running == {"tiny-chat": 2, "embed": 0}
    # The registry's endpoints of RUNNING replicas only, of the model they registered for.
    table = {"a": ("tiny-chat", "10.0.0.1", 4001), "b": ("tiny-chat", "10.0.0.1", 4002),
             "c": ("embed", "10.0.0.2", 4003), "stale": ("tiny-chat", "10.0.0.9", 1)}
    status = status_of(details, "llm", deployments, table, "tok")
    assert status.endpoints == {"tiny-chat": {"a": ("10.0.0.1", 4001)}, "embed": {}}
    assert status.token == "tok"
    details["applications"]["llm"]["status"] = "DELETING"
    assert status_of(details, "llm", deployments).deleting
    assert status_of({"applications": {}}, "llm", deployments) == Status()  # no news
    assert status_of({}, "llm", deployments) == Status()


def test_the_details_keys_read_are_ray_serves() -> None:
    """The names status_of reads, checked against Ray Serve's own schema (an upgrade that renames
    one fails here, not as a gateway that sees no replicas)."""
    from ray.serve._private.common import ReplicaState
    from ray.serve.schema import ApplicationDetails, ApplicationStatus, DeploymentDetails, ReplicaDetails

    assert {"status", "deployments"} <= set(ApplicationDetails.model_fields)
    assert "replicas" in DeploymentDetails.model_fields and "state" in ReplicaDetails.model_fields
    assert ReplicaState.RUNNING.value == "RUNNING" and ApplicationStatus.DELETING.value == "DELETING"


def test_the_fetch_outside_a_replica_fails_without_starting_ray() -> None:
    """Outside a Ray Serve replica (a unit test, a script) the fetch raises at once: asking for the
    controller first would start a Ray cluster of its own (ray.init) on every refresh. In a fresh
    interpreter: the suite's own driver may be connected to a stack's cluster already."""
    code = ("import ray; from ray.serve.exceptions import RayServeException; "
            "from serve_app.gateway.routing.replicas import serve_status_fetch\n"
            "try:\n    serve_status_fetch({'tiny-chat': 'model-tiny-chat'})()\n"
            "except RayServeException:\n    print('raised', ray.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "raised False", out.stdout + out.stderr[-2000:]


def test_a_registry_that_cannot_be_read_keeps_the_last_endpoints_and_new_counts() -> None:
    """The replica counts come from Ray Serve's controller; the endpoints from the registry. When
    only the registry fails (its node lost), the counts still follow the controller, and requests
    keep going to the endpoints last read (an unreachable one is skipped by the client)."""
    statuses = [Status({"m": 2}, endpoints={"m": {"a": ("h", 1), "b": ("h", 2)}}, token="t"),
                Status({"m": 1}, endpoints=None)]
    live = LiveReplicas(lambda: statuses.pop(0), 1.0)
    live.refresh()
    live.refresh()
    assert live.running("m") == 1
    assert live.endpoints("m") == {"a": ("h", 1), "b": ("h", 2)} and live.token == "t"
