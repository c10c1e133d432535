"""Capacity tests with locust against the session stack: per-tier verdicts, and the web UI's SLA tab."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadtests.harness import stack as harness
from tests.keys import create_key

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"
TIERS = ("premium", "standard", "batch")
VERDICT = re.compile(r"^SLA (premium|standard|batch): (PASS|FAIL|NO DATA) ttft_p95=.* tpot_p95=.*$", re.M)


@pytest.fixture(scope="module")
def tier_env(stack) -> dict[str, str]:
    """One key per tier (SERVE_APP_KEY_<TIER>), created in the running stack's keys file."""
    env = dict(os.environ)
    for tier in TIERS:
        env[f"SERVE_APP_KEY_{tier.upper()}"] = create_key(stack.keys_file, f"locust-{tier}", tier, ["*"])
    stack.wait_keys(accepted=[env[f"SERVE_APP_KEY_{t.upper()}"] for t in TIERS])
    return env


def _locust_args(stack) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE),
            "--app-config", str(stack.config), "--model", "tiny-chat",
            "--max-output-tokens", "32"]


def test_headless_run_prints_a_verdict_per_tier(stack, tier_env, tmp_path: Path) -> None:
    sla_json = tmp_path / "sla.json"
    t0 = time.monotonic()
    proc = subprocess.run(
        [*_locust_args(stack), "--host", stack.root_url, "--headless", "-u", "6", "-r", "3",
         "-t", "15s", "--only-summary", "--sla-json", str(sla_json)],
        cwd=ROOT, env=tier_env, capture_output=True, text=True, timeout=180,
    )
    print(f"\n[locust] headless run took {time.monotonic() - t0:.0f} s")
    out = proc.stdout + proc.stderr
    verdicts = dict((m.group(1), m.group(2)) for m in VERDICT.finditer(out))
    assert set(verdicts) == set(TIERS), out[-4000:]
    # Each tier's latency rows sit next to the HTTP rows in locust's own statistics.
    for tier in TIERS:
        assert re.search(rf"^POST\s+chat {tier}\s", out, re.M), out[-4000:]
        for kind in ("TTFT", "TPOT", "E2E"):
            assert re.search(rf"^{kind}\s+{tier}\s", out, re.M), out[-4000:]
    result = json.loads(sla_json.read_text())
    for t in result["tiers"]:
        assert t["requests"] > 0 and t["ttft_p95_ms"] is not None and t["tpot_p95_ms"] is not None, t
        assert t["ttft_objective_ms"] == {"premium": 1000, "standard": 2500, "batch": 15000}[t["tier"]]
    assert result["output_tokens"] > 0
    # The exit code is the verdict: 0 only if every tier passes.
    assert proc.returncode == (0 if all(v == "PASS" for v in verdicts.values()) else 1), out[-4000:]


def _chrome(tmp_path: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,900", f"--user-data-dir={tmp_path / 'chrome-profile'}"):
        opts.add_argument(flag)
    return webdriver.Chrome(options=opts, service=Service(executable_path="/usr/bin/chromedriver"))


def test_web_ui_sla_tab_shows_each_tier_live(stack, tier_env, tmp_path: Path) -> None:
    if not (Path("/usr/bin/chromium").exists() and Path("/usr/bin/chromedriver").exists()):
        pytest.skip("chromium is not installed (run scripts/system-deps.sh)")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    port = harness.free_port()
    ui = f"http://127.0.0.1:{port}"
    log = tmp_path / "locust-ui.log"
    proc = harness.spawn("locust web UI", [*_locust_args(stack), "--host", stack.root_url,
                                           "--web-host", "127.0.0.1", "--web-port", str(port)],
                         log, env=tier_env)
    driver = None
    try:
        harness.wait_until(lambda: harness.http_status(ui + "/", 1) == 200, [proc], "the locust web UI", 30)
        # Start a bounded run the way the UI's form does.
        r = httpx.post(ui + "/swarm", data={"user_count": "3", "spawn_rate": "3",
                                            "host": stack.root_url, "run_time": "180s"}, timeout=10)
        assert r.status_code == 200 and r.json()["success"], r.text
        # Wait until every tier has a TTFT sample.
        deadline = time.monotonic() + 60
        while True:
            tiers = {t["tier"]: t for t in httpx.get(ui + "/sla", timeout=5).json()["tiers"]}
            if set(tiers) == set(TIERS) and all(t["ttft_p95_ms"] is not None for t in tiers.values()):
                break
            assert time.monotonic() < deadline, tiers
            time.sleep(1)

        driver = _chrome(tmp_path)
        driver.get(ui + "/")
        wait = WebDriverWait(driver, 30)
        tab = wait.until(ec.element_to_be_clickable((By.XPATH, "//button[@role='tab' and normalize-space()='SLA']")))
        tab.click()
        for header in ("Tier", "Verdict", "TTFT p95 (ms)", "TTFT objective (ms)", "TPOT p95 (ms)"):
            wait.until(ec.presence_of_element_located((By.XPATH, f"//th[normalize-space()='{header}']")))
        rows: dict[str, list[str]] = {}

        def tier_rows(d) -> bool:
            rows.clear()
            for tr in d.find_elements(By.XPATH, "//table//tbody/tr"):
                cells = [td.text.strip() for td in tr.find_elements(By.TAG_NAME, "td")]
                if cells and cells[0] in TIERS:
                    rows[cells[0]] = cells
            # Live numbers: every tier has a TTFT p95 next to its objective.
            return set(rows) == set(TIERS) and all(c[4].isdigit() for c in rows.values())

        wait.until(tier_rows)
        assert rows["premium"][5] == "1000" and rows["standard"][5] == "2500" and rows["batch"][5] == "15000"
        for cells in rows.values():
            assert cells[1] in ("PASS", "FAIL"), cells
        shot = tmp_path / "locust-sla-tab.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        print(f"\n[locust] SLA tab screenshot: {shot}")
    finally:
        if driver is not None:
            driver.quit()
        try:
            httpx.post(ui + "/stop", timeout=10)  # POST, as the UI's stop button does
        except httpx.HTTPError:
            pass
        harness.stop(proc, timeout_s=30)
    # Stopping the run printed the verdict too.
    assert VERDICT.search(log.read_text()), log.read_text()[-3000:]
