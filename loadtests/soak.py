"""Soak: mixed-tier streaming locust load with a model replica killed every few minutes.

    python -m loadtests.soak --minutes 10                      # starts configs/local.yaml itself
    python -m loadtests.soak --minutes 10 --base-url http://127.0.0.1:8000/v1 \\
        --keys premium=sk-...,standard=sk-...,batch=sk-... --root-pid PID_OF_SERVE_APP_RUN

Every request must either complete, end with an error event (and ``[DONE]``), or get 503/429
with ``Retry-After``; none may be cut silently, none may get a 500. Afterwards each key's
``GET /v1/usage`` must match what the client counted: one request per request sent, and the
completion tokens of the completed streams (plus at most ``max_tokens`` for each stream ended by an
error event). Prints a JSON report; exits 1 if a rule is broken.

Run it under ``flock /tmp/serve-app-stack.lock`` on a shared machine. Locust runs in library mode
in this process (it patches the standard library with gevent, so it is never imported by pytest:
tests/integration/test_soak.py runs this module as a subprocess).
"""

from __future__ import annotations

if __name__ == "__main__":  # locust's gevent must patch ssl before anything imports it
    from gevent import monkey

    monkey.patch_all()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from loadtests.harness.faults import OK_KINDS, classify, find_replicas  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("premium", "standard", "batch")


def parse_sse(lines: Any) -> tuple[bool, bool, bool, int]:
    """(finished, error_event, done, completion tokens) of an OpenAI chat stream's lines."""
    finished = error = done = False
    tokens = 0
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line.startswith("data: "):
            continue
        data = line[6:].strip()
        if data == "[DONE]":
            done = True
            continue
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if "error" in event:
            error = True
            continue
        if event.get("usage"):
            tokens = int(event["usage"].get("completion_tokens") or 0)
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                finished = True
    return finished, error, done, tokens


def check(report: dict[str, Any], max_tokens: int) -> list[str]:
    """The soak's rules, applied to its report; returns what was broken."""
    problems = []
    for tier, t in report["tiers"].items():
        bad = {k: n for k, n in t["kinds"].items() if k not in OK_KINDS}
        if bad:
            problems.append(f"{tier}: {bad} ({t['examples'][:3]})")
        if t["usage_requests"] != t["sent"]:
            problems.append(f"{tier}: /v1/usage counted {t['usage_requests']} requests, "
                            f"the client sent {t['sent']}")
        low, high = t["tokens_completed"], t["tokens_completed"] + max_tokens * t["kinds"].get(
            "error_event", 0)
        if not low <= t["usage_completion_tokens"] <= high:
            problems.append(f"{tier}: /v1/usage counted {t['usage_completion_tokens']} completion "
                            f"tokens, the client counted {low} (up to {high} with cut streams)")
    if report["kills"] == 0:
        problems.append("no replica was killed")
    return problems


Usage = dict[str, dict[str, Any]]  # tier -> that key's GET /v1/usage


def settled_usage(read: Callable[[], Usage], booked: Callable[[Usage], bool],
                  sleep: Callable[[float], object], clock: Callable[[], float] = time.monotonic,
                  *, quiet_s: float = 5.0, timeout_s: float = 60.0, poll_s: float = 0.25) -> Usage:
    """The usage once the gateway has booked every request: the gateway closes a request's books
    just after its answer, so the first reading may lag the client. Returns as soon as ``booked``
    says the reading accounts for what the client saw; otherwise once the reading has stayed the
    same for ``quiet_s`` (nothing more is coming: the verdict then names the difference), and at
    ``timeout_s`` at most."""
    start = last_change = clock()
    reading = read()
    while not booked(reading) and clock() - last_change < quiet_s and clock() - start < timeout_s:
        sleep(poll_s)
        again = read()
        if again != reading:
            reading, last_change = again, clock()
    return reading


def run(base_url: str, keys: dict[str, str], root_pid: int, *, minutes: float,
        kill_every_s: float, users: int, max_tokens: int, model: str,
        deployment: str) -> dict[str, Any]:
    import gevent
    import requests
    from locust import HttpUser, constant, task
    from locust.env import Environment

    results: dict[str, list[tuple[str, int, str]]] = {t: [] for t in keys}
    # At the end no new request starts and the ones in flight finish, so that every request the
    # gateway counted is one the client counted too.
    flow = {"stopping": False, "in_flight": 0}

    def usage(secret: str) -> dict[str, Any]:
        r = requests.get(f"{base_url}/usage", headers={"Authorization": f"Bearer {secret}"},
                         timeout=30)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    before = {tier: usage(secret) for tier, secret in keys.items()}

    class SoakUser(HttpUser):
        abstract = True
        host = base_url.removesuffix("/v1")
        wait_time = constant(0.1)
        tier = ""

        @task
        def chat(self) -> None:
            if flow["stopping"]:
                gevent.sleep(0.5)
                return
            body = {"model": model, "messages": [{"role": "user", "content": "a story please"}],
                    "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            headers = {"Authorization": f"Bearer {keys[self.tier]}"}
            flow["in_flight"] += 1
            try:
                self._send(body, headers)
            finally:
                flow["in_flight"] -= 1

        def _send(self, body: dict[str, Any], headers: dict[str, str]) -> None:
            kind, tokens, detail = "cut", 0, ""
            with self.client.post("/v1/chat/completions", json=body, headers=headers,
                                  stream=True, timeout=120, name=self.tier,
                                  catch_response=True) as r:
                try:
                    if r.status_code != 200:
                        kind = classify(r.status_code, r.headers.get("retry-after"))
                        detail = r.text[:160]
                    else:
                        finished, error, done, tokens = parse_sse(r.iter_lines())
                        kind = classify(200, None, finished=finished and done,
                                        error_event=error and done)
                except Exception as exc:  # a stream cut in the middle
                    kind, detail = "cut", type(exc).__name__
                results[self.tier].append((kind, tokens, detail))
                if kind in OK_KINDS:
                    r.success()
                else:
                    r.failure(f"{kind}: {detail}")

    classes = [type(f"{tier.title()}User", (SoakUser,), {"tier": tier}) for tier in keys]
    env = Environment(user_classes=classes)
    runner = env.create_local_runner()
    # Each tier gets its share of users (at least one).
    runner.start(len(classes) * max(1, users // len(classes)), spawn_rate=10, user_classes=None)
    kills: list[dict[str, Any]] = []
    t0 = time.monotonic()
    end = t0 + minutes * 60
    next_kill = t0 + min(kill_every_s / 4, 30.0)
    while time.monotonic() < end:
        if time.monotonic() >= next_kill:
            pids = find_replicas(root_pid, deployment)
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                kills.append({"at_s": round(time.monotonic() - t0, 1), "pid": pids[0]})
                print(f"[soak] killed replica {pids[0]} of {deployment} at "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
            next_kill += kill_every_s
        gevent.sleep(0.5)
    flow["stopping"] = True
    drain_end = time.monotonic() + 120
    while flow["in_flight"] and time.monotonic() < drain_end:
        gevent.sleep(0.2)
    runner.quit()

    def booked(after: Usage) -> bool:
        return all(
            after[t]["requests"] - before[t]["requests"] == len(rs)
            and after[t]["completion_tokens"] - before[t]["completion_tokens"]
            >= sum(n for k, n, _ in rs if k == "completed")
            for t, rs in results.items())

    after = settled_usage(lambda: {tier: usage(secret) for tier, secret in keys.items()}, booked,
                          gevent.sleep)
    report: dict[str, Any] = {"minutes": minutes, "kills": len(kills), "kill_times": kills,
                              "tiers": {}}
    for tier, rs in results.items():
        kinds = Counter(k for k, _, _ in rs)
        report["tiers"][tier] = {
            "sent": len(rs),
            "kinds": dict(kinds),
            "tokens_completed": sum(n for k, n, _ in rs if k == "completed"),
            "usage_requests": after[tier]["requests"] - before[tier]["requests"],
            "usage_completion_tokens": (after[tier]["completion_tokens"]
                                        - before[tier]["completion_tokens"]),
            "examples": [f"{k}: {d}" for k, _, d in rs if k not in OK_KINDS][:5],
        }
    return report


def _own_stack(workdir: Path) -> Any:
    from loadtests.harness.stack import start_stack

    return start_stack(ROOT / "configs/local.yaml", workdir,
                       keys={f"soak-{t}": (t, ["*"]) for t in TIERS})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--kill-every", type=float, default=120.0, help="seconds between replica kills")
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default="tiny-chat")
    p.add_argument("--deployment", default="model-tiny-chat")
    p.add_argument("--base-url", default="", help="a running app (else configs/local.yaml is started)")
    p.add_argument("--keys", default="", help="tier=secret,... for --base-url")
    p.add_argument("--root-pid", type=int, default=0, help="pid of the running `serve-app run`")
    p.add_argument("--json", default="", help="also write the report here")
    ns = p.parse_args(argv)
    stack = None
    if ns.base_url:
        keys = dict(part.split("=", 1) for part in ns.keys.split(",") if part)
        base_url, root = ns.base_url, ns.root_pid
    else:
        stack = _own_stack(Path(tempfile.mkdtemp(prefix="serve-app-soak-")))
        keys = {t: stack.keys[f"soak-{t}"] for t in TIERS}
        base_url, root = stack.base_url, stack.proc.pid
    try:
        report = run(base_url, keys, root, minutes=ns.minutes, kill_every_s=ns.kill_every,
                     users=ns.users, max_tokens=ns.max_tokens, model=ns.model,
                     deployment=ns.deployment)
    finally:
        if stack is not None:
            stack.stop()
    report["problems"] = check(report, ns.max_tokens)
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if ns.json:
        Path(ns.json).write_text(text)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
