"""API8 (security misconfiguration), header spoofing: a client can never set the SLA clock.

``X-Request-Start`` is trusted only where the front door deletes a client's own and stamps its
arrival (the project's HAProxy rules, which set ``SERVE_APP_STAMPING_FRONT_DOOR``). On Ray's stock
HAProxy (a KubeRay cluster without those rules) the header was trusted as it came (issue 36), so a
client could forge its own wait and drive the SLO autoscaler."""

from __future__ import annotations

import time
from pathlib import Path

from serve_app.gateway.accounting.timing import (
    STAMPING_FRONT_DOOR_ENV,
    StageClock,
    trusts_arrival_stamp,
)
from serve_app.local import front_door


def test_the_stamp_is_trusted_only_behind_the_stamping_front_door(tmp_path: Path) -> None:
    assert not trusts_arrival_stamp(False, {STAMPING_FRONT_DOOR_ENV: "1"})  # Ray's proxy actor
    assert not trusts_arrival_stamp(True, {})  # Ray's stock HAProxy: passes the client's header
    env = front_door.haproxy_env(tmp_path, "127.0.0.1", "/bin/true")
    assert trusts_arrival_stamp(env["RAY_SERVE_ENABLE_HA_PROXY"] == "1", env)


def test_a_forged_stamp_does_not_move_the_clock_when_untrusted() -> None:
    forged = f"t={int((time.time() - 3600) * 1e6)}".encode()  # "I waited an hour"
    scope = {"headers": [(b"x-request-start", forged)]}
    clock = StageClock.for_request(scope, trust_stamp=trusts_arrival_stamp(True, {}))
    assert time.time() - clock.arrival < 5
