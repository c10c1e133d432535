"""Dashboards and alert rules as code: committed files are fresh, read only declared metrics, hold
the config's objectives, and the rules pass ``promtool check rules`` and ``promtool test rules``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards.__main__ import GRAFANA_DIR
from dashboards.__main__ import main as generate
from dashboards.queries import boards, concrete, le
from serve_app.config import load_app_config
from serve_app.metrics import declared_series

ROOT = Path(__file__).resolve().parents[2]
DASH = ROOT / "dashboards"
CONFIG = ROOT / "configs/local.yaml"
METRIC = re.compile(r"\bray_[A-Za-z0-9_]+")


def _dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(GRAFANA_DIR.glob("*.json"))}


def _panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in d["panels"] if p.get("type") != "row"]


def _alert_exprs() -> list[str]:
    doc = yaml.safe_load((DASH / "alerts.yaml").read_text())
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool is not installed (run scripts/system-deps.sh)")
    return exe


def test_committed_files_are_what_the_generator_makes(capsys: pytest.CaptureFixture[str]) -> None:
    assert generate(["--check"]) == 0, capsys.readouterr().err


def test_check_fails_when_an_objective_changes(tmp_path: Path) -> None:
    doc = yaml.safe_load(CONFIG.read_text())
    doc["applications"][0]["args"]["tiers"]["premium"]["objectives"]["ttft_p95_ms"] = 750
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(doc))
    assert generate(["--check", "--config", str(config)]) == 1


def test_three_dashboards_with_panels() -> None:
    ds = _dashboards()
    assert set(ds) == {"serve-app-sla", "serve-app-engines", "serve-app-capacity"}
    for d in ds.values():
        assert _panels(d)
        for p in _panels(d):
            assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
            assert p["datasource"]["uid"] == "prometheus"


def test_every_metric_a_dashboard_or_alert_reads_is_declared() -> None:
    declared = declared_series()
    exprs = [t["expr"] for d in _dashboards().values() for p in _panels(d) for t in p["targets"]]
    exprs += _alert_exprs()
    used = set()
    for expr in exprs:
        names = METRIC.findall(expr)
        assert names, f"no metric in {expr}"
        used.update(names)
    assert used - declared == set(), "undeclared metrics: " + ", ".join(sorted(used - declared))
    # every gateway metric is on a dashboard
    assert {n for n in declared if n.startswith("ray_serve_app_") and not n.endswith(("_sum",))} - used <= {
        "ray_serve_app_slo_misses_total", "ray_serve_app_tokens_total",
        "ray_serve_app_ttft_seconds", "ray_serve_app_tpot_seconds", "ray_serve_app_stage_seconds",
        "ray_serve_app_queue_wait_seconds"}


def test_each_tier_has_its_objectives_as_thresholds() -> None:
    cfg = load_app_config(CONFIG)
    sla = _dashboards()["serve-app-sla"]
    by_title = {p["title"]: p for p in _panels(sla)}
    for name, tier in cfg.tiers.items():
        for kind, objective_ms in (("TTFT", tier.objectives.ttft_p95_ms),
                                   ("TPOT", tier.objectives.tpot_p95_ms)):
            panel = by_title[f"{name}: {kind} p95 vs objective"]
            steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
            assert steps[-1]["value"] == pytest.approx(objective_ms / 1000)
            assert f'tier=\\"{name}\\"' in json.dumps(panel["targets"])
        share = json.dumps(by_title[f"{name}: share of requests within objective"]["targets"])
        assert f'le=\\"{le(tier.objectives.ttft_p95_ms / 1000)}\\"' in share


def test_the_capacity_board_has_a_flow_queue_row() -> None:
    capacity = _dashboards()["serve-app-capacity"]
    rows = [p["title"] for p in capacity["panels"] if p.get("type") == "row"]
    assert "Gateway flow queue" in rows
    exprs = json.dumps([p["targets"] for p in _panels(capacity) if p["title"].startswith("Flow queue")])
    for metric in ("queue_depth", "queue_wait_seconds_bucket", "flow_inflight_bound"):
        assert f"ray_serve_app_{metric}" in exprs
    assert "sum by (model, tenant)" in exprs and "sum by (le, tier)" in exprs


def test_concrete_replaces_grafanas_range_variable() -> None:
    cfg = load_app_config(CONFIG)
    for b in boards(cfg):
        for p in b.panels():
            for t in p.targets:
                assert "$" not in concrete(t.expr, "1m")


def test_le_matches_rays_exported_label_format() -> None:
    # As scraped from Ray 2.60's export: le="1.0", le="0.3", le="100.0".
    assert (le(1), le(0.3), le(15), le(0.15)) == ("1.0", "0.3", "15.0", "0.15")


def test_promtool_check_rules() -> None:
    out = subprocess.run([_promtool(), "check", "rules", str(DASH / "alerts.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 11 rules found" in out.stdout


def test_promtool_test_rules_fire_and_stay_silent() -> None:
    out = subprocess.run([_promtool(), "test", "rules", "alerts.test.yaml"], cwd=DASH,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_promtool_test() -> None:
    doc = yaml.safe_load((DASH / "alerts.yaml").read_text())
    alerts = {r["alert"] for g in doc["groups"] for r in g["rules"]}
    tests = yaml.safe_load((DASH / "alerts.test.yaml").read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t["alert_rule_test"] if a["exp_alerts"]}
    silent = {a["alertname"] for t in tests for a in t["alert_rule_test"] if not a["exp_alerts"]}
    assert alerts <= fired, f"never shown firing: {alerts - fired}"
    assert alerts - {"GatewayErrorRateHigh", "TierTPOTP95OverObjective"} <= silent


def test_provisioning_datasource_uid_matches_the_dashboards() -> None:
    ds = yaml.safe_load((DASH / "provisioning/datasources/prometheus.yaml").read_text())
    assert ds["datasources"][0]["uid"] == "prometheus"
    prov = yaml.safe_load((DASH / "provisioning/dashboards/serve-app.yaml").read_text())
    assert prov["providers"][0]["type"] == "file"


def test_grafana_client_did_not_replace_urllib3() -> None:
    # grafana-client pulls urllib3-future, whose wheel overwrites urllib3 at interpreter start
    # (scripts/install.sh builds it from source with URLLIB3_NO_OVERRIDE=1 instead).
    import urllib3

    site = Path(urllib3.__file__).parents[1]
    assert not (site / "urllib3_future.pth").exists()
    assert not (Path(urllib3.__file__).parent / ".u3f_sync").exists()
