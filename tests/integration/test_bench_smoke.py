"""The benchmark's smoke mode against the session stack: both sides serve every token."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke_gateway_matches_direct_vllm(stack, tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests.bench", "--smoke",
         "--gateway-url", stack.base_url, "--api-key", stack.keys["all"],
         "--results-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    elapsed = time.monotonic() - t0
    print(f"\n[bench] smoke run took {elapsed:.0f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAIL" not in proc.stdout

    [result_file] = tmp_path.glob("bench-*.json")
    result = json.loads(result_file.read_text())
    assert result["passed"] and not result["problems"]
    for c in ("1", "4"):
        direct, gateway = result["summary"][c]["direct"], result["summary"][c]["gateway"]
        expected = result["meta"]["num_prompts"][c] * result["meta"]["output_len"]
        assert direct["total_output_tokens"] == gateway["total_output_tokens"] == expected
        assert direct["failed_all_repeats"] == gateway["failed_all_repeats"] == 0
    assert (tmp_path / result_file.name.replace(".json", ".md")).exists()
