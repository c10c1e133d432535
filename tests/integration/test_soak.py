"""A short soak, part of every run (CI included; about 2.5 min): mixed-tier locust load on the
session stack for 2 minutes with the chat model's replica killed once, 30 s in. Every request
completes, ends with an error event, or gets 503/429 with Retry-After, and each key's /v1/usage
matches what the client counted. Marked ``soak`` so it runs after the fault tests
(tests/conftest.py); the long run is ``python -m loadtests.soak --minutes 10``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.harness.stack import keys_create

pytestmark = [pytest.mark.integration, pytest.mark.soak]

ROOT = Path(__file__).resolve().parents[2]
TIERS = ("premium", "standard", "batch")


def test_soak_with_a_replica_kill(stack, tmp_path: Path) -> None:
    keys = {t: keys_create(stack.keys_file, f"soak-{t}", t) for t in TIERS}
    stack.wait_keys(accepted=list(keys.values()))
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests.soak", "--minutes", "2", "--kill-every", "120",
         "--users", "6", "--base-url", stack.base_url, "--root-pid", str(stack.proc.pid),
         "--keys", ",".join(f"{t}={s}" for t, s in keys.items()), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    print("\n[soak]", json.dumps({t: r["kinds"] for t, r in report["tiers"].items()}),
          "kills", report["kill_times"])
    assert report["problems"] == [], report
    assert proc.returncode == 0
