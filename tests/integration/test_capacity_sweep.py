"""A 2-value sweep of max_num_seqs: two redeploys of the app, each under the same short locust load.

Independent of the session stack and of test order: the sweep starts stacks of its own, one at a
time, through the stack harness, which stops each one's whole process tree (Ray's included), and
the session's Ray handles connect to the session stack's own cluster by its address.
"""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1800)  # two app start-ups; slow when the shared machine is busy
def test_two_value_sweep_writes_csv_table_plot_and_recommendation(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests.sweep", "--config", "configs/local.yaml", "--model", "tiny-chat",
         "--param", "max_num_seqs=4,8", "--users", "4", "--spawn-rate", "4", "--duration", "8s",
         "--max-output-tokens", "32", "--warmup-requests", "2", "--results-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1700,
    )
    print(f"\n[sweep] 2-value sweep took {time.monotonic() - t0:.0f} s")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    # Progress for each value, then the recommendation.
    for i, value in ((1, 4), (2, 8)):
        assert f"[{i}/2] max_num_seqs={value}" in log
    assert "Recommendation: " in log

    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["max_num_seqs"] for r in rows] == ["4", "8"]
    for r in rows:
        assert float(r["output_tokens_per_s"]) > 0
        assert float(r["ttft_p50_ms"]) <= float(r["ttft_p95_ms"])
        assert float(r["tpot_p95_ms"]) > 0
        assert int(r["requests"]) > 0 and r["errors"] != ""
        # The model replica (vLLM engine included) is far bigger than an idle Python process.
        assert int(r["peak_replica_rss_bytes"]) > 200 * 2**20
        for tier in ("premium", "standard", "batch"):
            assert r[f"{tier}_sla"] in ("PASS", "FAIL"), r

    table = (out / "sweep.md").read_text()
    assert "| max_num_seqs | output tok/s | TTFT p50 ms | TTFT p95 ms |" in table
    assert "Recommendation: " in table
    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
