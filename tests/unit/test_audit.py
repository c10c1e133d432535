"""serve_app.gateway.accounting.audit: one JSON line per event, bounded by rotation, counted."""

from __future__ import annotations

from pathlib import Path

from serve_app.gateway.accounting.audit import Audit
from serve_app.state.audit import AuditFile


class Counted:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def audited(self, *, action: str, result: str) -> None:
        self.seen.append((action, result))


def test_lines_hold_who_did_what(tmp_path: Path) -> None:
    metrics = Counted()
    audit = Audit(AuditFile(tmp_path / "audit.log", 1_000_000), metrics, clock=lambda: 0.0)
    audit.record("key.create", actor="admin", target="team-a", result="ok")
    audit.record("auth_failed", actor=None, target=None, result="unknown", route="/v1/models")
    assert audit.lines() == [
        {"time": "1970-01-01T00:00:00.000+00:00", "actor": "admin", "action": "key.create",
         "target": "team-a", "result": "ok"},
        {"time": "1970-01-01T00:00:00.000+00:00", "actor": None, "action": "auth_failed",
         "target": None, "result": "unknown", "route": "/v1/models"},
    ]
    assert metrics.seen == [("key.create", "ok"), ("auth_failed", "unknown")]


def test_the_file_is_bounded(tmp_path: Path) -> None:
    audit = Audit(AuditFile(tmp_path / "audit.log", 500))
    for i in range(100):
        audit.record("key.get", actor="admin", target=f"k{i}", result="ok")
    sizes = [p.stat().st_size for p in tmp_path.iterdir()]
    assert len(sizes) == 2 and max(sizes) < 500 + 200
    assert audit.lines()[-1]["target"] == "k99"
