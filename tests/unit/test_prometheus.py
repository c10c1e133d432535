"""The Prometheus helper: config generation and Ray's service-discovery format (no process)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from serve_app.local.prometheus import (
    Prometheus,
    build_config,
    targets_from_nodes,
    targets_from_session,
    write_sd_file,
)


def test_config_scrapes_the_discovery_file_and_loads_rules(tmp_path: Path) -> None:
    doc = build_config(tmp_path / "sd.json", scrape_interval_s=5, rule_files=[tmp_path / "a.yaml"])
    job = doc["scrape_configs"][0]
    assert job["file_sd_configs"][0]["files"] == [str(tmp_path / "sd.json")]
    assert doc["global"]["scrape_interval"] == "5s"
    assert doc["rule_files"] == [str(tmp_path / "a.yaml")]


def test_targets_from_live_nodes_only() -> None:
    nodes = [{"NodeManagerAddress": "10.0.0.5", "MetricsExportPort": 1234, "Alive": True},
             {"NodeManagerAddress": "10.0.0.6", "MetricsExportPort": 99, "Alive": False}]
    assert targets_from_nodes(nodes) == ["10.0.0.5:1234"]


def test_targets_from_session_port_files(tmp_path: Path) -> None:
    (tmp_path / "metrics_export_port_abc").write_text("40299")
    assert targets_from_session(tmp_path, "192.0.2.2") == ["192.0.2.2:40299"]


def test_sd_file_has_rays_format(tmp_path: Path) -> None:
    path = write_sd_file(tmp_path / "x" / "sd.json", ["192.0.2.2:1"])
    assert json.loads(path.read_text()) == [{"labels": {"job": "ray"}, "targets": ["192.0.2.2:1"]}]


def test_written_config_is_yaml_and_listens_on_loopback(tmp_path: Path) -> None:
    p = Prometheus(tmp_path, tmp_path / "sd.json", port=9999)
    doc = yaml.safe_load(p.write_config().read_text())
    assert doc["scrape_configs"][0]["job_name"] == "ray"
    assert p.url == "http://127.0.0.1:9999"
