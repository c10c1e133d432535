"""The audit trail holds against anonymous traffic (issue 36): failed authentications without a
valid key are sampled, so they cannot rotate authenticated actions out of the bounded trail."""

from __future__ import annotations

from pathlib import Path

from serve_app.gateway.accounting.audit import Audit
from serve_app.state.audit import AuditFile


def test_anonymous_failures_cannot_rotate_authenticated_actions_out_of_the_audit(
    tmp_path: Path,
) -> None:
    now = [1_000_000.0]
    audit = Audit(AuditFile(tmp_path / "audit.log", 64 * 1024), clock=lambda: now[0])
    audit.record("key.revoke", actor="root", target="team-a", result="ok")
    for _ in range(50_000):  # an anonymous flood: 50k 401s in one minute
        audit.record("auth_failed", actor=None, target=None, result="unknown", route="/v1/models")
    now[0] += 60
    audit.record("auth_failed", actor=None, target=None, result="unknown", route="/v1/models")
    lines = audit.lines()
    assert lines[0]["action"] == "key.revoke"  # still there: the trail never rotated
    failed = [x for x in lines if x["action"] == "auth_failed"]
    assert len(failed) == 61
    assert [x["result"] for x in lines if x["action"] == "auth_failed_suppressed"] == ["49940"]
    # A known key's failure (expired) is never sampled away.
    audit.record("auth_failed", actor="team-a", target=None, result="expired")
    assert audit.lines()[-1]["actor"] == "team-a"
