"""The benchmark's smoke mode against the session stack: both sides serve every token."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtests.harness import stack as harness

pytestmark = pytest.mark.integration

TIMEOUT_S = 420  # about 90 s here when idle; a loaded machine slows the vLLM start-up most


def test_bench_smoke_gateway_matches_direct_vllm(stack, tmp_path: Path) -> None:
    t0 = time.monotonic()
    log = tmp_path / "bench.out"
    proc = harness.spawn("smoke benchmark", [
        sys.executable, "-m", "loadtests.bench", "--smoke",
        "--gateway-url", stack.base_url, "--api-key", stack.keys["all"],
        "--results-dir", str(tmp_path)], log)
    try:
        code = proc.popen.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the smoke benchmark took over {TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
    finally:
        harness.stop(proc, timeout_s=60)  # SIGINT first: the bench stops the vLLM it started
    output = log.read_text(errors="replace")
    print(f"\n[bench] smoke run took {time.monotonic() - t0:.0f} s")
    assert code == 0, output[-6000:]
    assert "[bench] FAIL" not in output

    [result_file] = tmp_path.glob("bench-*.json")
    result = json.loads(result_file.read_text())
    assert result["passed"] and not result["problems"]
    for c in ("1", "4"):
        direct, gateway = result["summary"][c]["direct"], result["summary"][c]["gateway"]
        expected = result["meta"]["num_prompts"][c] * result["meta"]["output_len"]
        assert direct["total_output_tokens"] == gateway["total_output_tokens"] == expected
        assert direct["failed_all_repeats"] == gateway["failed_all_repeats"] == 0
    assert (tmp_path / result_file.name.replace(".json", ".md")).exists()
