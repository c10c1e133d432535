"""``serve-app diagnose``: the running app's status, its gateway's diagnostics and each model
replica's slot counts, read through a driver that joins the local Ray cluster."""

from __future__ import annotations

import json
import logging
from typing import Any

from serve_app.config import APP_NAME
from serve_app.local.stack import app_status


def run() -> int:
    import ray
    from ray import serve

    from serve_app.app import GATEWAY_DEPLOYMENT

    ray.init(address="auto", log_to_driver=False, logging_level=logging.ERROR)
    status = serve.status()
    state, detail = app_status(status)
    print(f"app {APP_NAME}: {state} {detail}")
    if state == "RUNNING":
        gw = serve.get_deployment_handle(GATEWAY_DEPLOYMENT, app_name=APP_NAME)
        diag = gw.diagnostics.remote().result(timeout_s=10)
        print("gateway:", json.dumps(diag))
        for line in flow_lines(diag.get("flow") or {}):
            print(line)
        # The Batch API's latest batches (every tenant's), from the store the replicas share.
        for b in gw.batches.remote().result(timeout_s=10):
            print(f"batch {b['id']}: {b['status']} {b['completed']}+{b['failed']}/{b['total']} "
                  f"lines, {b['endpoint']}, key {b['key_id']}")
        # One replica of each model answers: requests in its engine, and those waiting in the
        # replica for a slot (admission.reserved_slots keeps some for the top tier).
        for name in sorted(status.applications[APP_NAME].deployments):
            if name != GATEWAY_DEPLOYMENT:
                model = serve.get_deployment_handle(name, app_name=APP_NAME)
                print(f"{name}:", json.dumps(model.stats.remote().result(timeout_s=10)))
    return 0


def flow_lines(flow: dict[str, Any]) -> list[str]:
    """One line per model with a gateway flow queue (one gateway replica's view): its in-flight
    bound and count, and who waits, by tier and tenant, with the oldest wait per tier."""
    lines = []
    for model, q in sorted(flow.items()):
        line = (f"flow queue {model}: {q['inflight']} in flight of {q['bound']}, "
                f"{q['waiting']} waiting")
        for tier, tenants in sorted(q["waiting_by_tier_tenant"].items()):
            who = ", ".join(f"{t} {n}" for t, n in sorted(tenants.items()))
            line += f"; {tier}: {who} (oldest {q['oldest_wait_s_by_tier'].get(tier, 0):.1f} s)"
        lines.append(line)
    return lines
