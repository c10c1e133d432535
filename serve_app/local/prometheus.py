"""A local Prometheus that scrapes Ray's metrics export: config generation, start, stop, queries.

When its dashboard runs, Ray writes the addresses of every node's metrics export to
``<session dir>/prom_metrics_service_discovery.json`` in Prometheus's file-based service-discovery
format and keeps it current. ``serve-app run`` starts Ray without the dashboard, so no such file
exists: ``write_sd_file`` writes one in the same format from the node list (``ray.nodes()``, when
connected) or from the session's ``metrics_export_port_*`` files. The generated config points
``file_sd_configs`` at either file. Ray binds its export to the node's IP (not loopback); on a
single machine that address is this machine. Prometheus itself listens on 127.0.0.1 only.

Debian's ``prometheus`` package provides the binary and ``promtool`` (scripts/system-deps.sh).
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

SD_FILE = "prom_metrics_service_discovery.json"  # ray._private.ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE
DEFAULT_RAY_TEMP = Path("/tmp/ray")


def ray_session_dir(temp_dir: Path = DEFAULT_RAY_TEMP) -> Path:
    """The newest Ray session on this machine (``session_latest`` resolved)."""
    return (temp_dir / "session_latest").resolve()


def sd_file(session_dir: Path) -> Path:
    """Ray's Prometheus service-discovery file for one session."""
    return session_dir / SD_FILE


def targets_from_nodes(nodes: list[dict[str, Any]]) -> list[str]:
    """``host:port`` of each live node's metrics export, as Ray's own discovery writer lists them."""
    return [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in nodes if n.get("Alive", n.get("alive"))]


def targets_from_session(session_dir: Path, node_ip: str) -> list[str]:
    """``node_ip:port`` for each ``metrics_export_port_<node id>`` file of a local session."""
    return [f"{node_ip}:{int(p.read_text().strip())}"
            for p in sorted(session_dir.glob("metrics_export_port_*"))]


def write_sd_file(path: Path, targets: list[str]) -> Path:
    """A file-SD file in the format Ray writes (atomic replace, as Prometheus may read it any time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": targets}]))
    tmp.replace(path)
    return path


def find_binary(name: str = "prometheus") -> str | None:
    return shutil.which(name)


def build_config(sd_path: Path, *, scrape_interval_s: float = 5.0,
                 rule_files: list[Path] | None = None) -> dict[str, Any]:
    """Prometheus's config: scrape every target in Ray's discovery file; evaluate ``rule_files``."""
    interval = f"{scrape_interval_s:g}s"
    doc: dict[str, Any] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{
            "job_name": "ray",
            "file_sd_configs": [{"files": [str(sd_path)], "refresh_interval": interval}],
        }],
    }
    if rule_files:
        doc["rule_files"] = [str(p) for p in rule_files]
    return doc


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Prometheus:
    """One Prometheus process on 127.0.0.1, with its config and data in ``workdir``."""

    workdir: Path
    sd_path: Path
    port: int = 0
    rule_files: list[Path] = field(default_factory=list)
    scrape_interval_s: float = 5.0
    binary: str = "prometheus"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_config(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "prometheus.yml"
        doc = build_config(self.sd_path, scrape_interval_s=self.scrape_interval_s,
                           rule_files=self.rule_files)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def start(self, timeout_s: float = 30.0) -> str:
        """Start and wait until ready; returns the URL."""
        binary = find_binary(self.binary) or self.binary
        config = self.write_config()
        self.port = self.port or free_loopback_port()
        log = open(self.workdir / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d",
             "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: "
                                   f"{(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        logger.info("Prometheus ready at %s", self.url)
                        return self.url
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"prometheus not ready in {timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
