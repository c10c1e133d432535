"""Capacity test: streaming chat load per SLA tier through the gateway, with a verdict per tier.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000            # web UI on :8089
    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000 --headless -u 12 -r 4 -t 2m

Keys come from SERVE_APP_KEY_PREMIUM, SERVE_APP_KEY_STANDARD and SERVE_APP_KEY_BATCH (a tier
without a key gets no users). Besides the HTTP rows, every tier gets three latency rows: TTFT,
TPOT and E2E (request type) named after the tier. When a test stops, one line per tier compares
p95 TTFT and TPOT with the tier's objectives in the app config; the process exits 1 if a tier
misses them (or has no successful request), 0 otherwise. The web UI has an "SLA" tab with the
same comparison, live.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from flask import request as flask_request
from locust import HttpUser, between, events, task
from locust.env import Environment
from locust.stats import StatsEntry

# locust imports this file by path: make the repo root importable for loadtests.* and serve_app.*
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from loadtests.prompts import Prompt, load_prompts  # noqa: E402 (after the sys.path line)
from loadtests.sla import DEFAULT_APP_CONFIG, E2E, TPOT, TTFT, Objective, TierResult, read_objectives  # noqa: E402

logger = logging.getLogger("loadtests.sla")
KEY_ENV = "SERVE_APP_KEY_{}"
CHAT_PATH = "/v1/chat/completions"


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    g = parser  # (argument groups do not take include_in_web_ui)
    g.add_argument("--app-config", default=DEFAULT_APP_CONFIG, env_var="SERVE_APP_CONFIG",
                   help="app config whose tiers' objectives the verdict uses")
    g.add_argument("--model", default="tiny-chat", env_var="SERVE_APP_MODEL", help="model to load")
    g.add_argument("--prompts", default="", env_var="SERVE_APP_PROMPTS",
                   help="prompts JSONL (default: the bundled set) or a ShareGPT JSON file")
    g.add_argument("--mix", default="premium=1,standard=2,batch=1", env_var="SERVE_APP_MIX",
                   help="users per tier by weight, e.g. premium=1,standard=2,batch=1")
    g.add_argument("--max-output-tokens", type=int, default=512, env_var="SERVE_APP_MAX_OUTPUT_TOKENS",
                   help="cap on each request's max_tokens")
    g.add_argument("--ignore-eos", default="true", env_var="SERVE_APP_IGNORE_EOS",
                   help="ask the engine for exactly max_tokens tokens (true/false)")
    g.add_argument("--sla-max-error-rate", type=float, default=0.05, env_var="SERVE_APP_SLA_MAX_ERROR_RATE",
                   help="a tier with a larger share of failed requests fails its SLA")
    g.add_argument("--sla-json", default="", env_var="SERVE_APP_SLA_JSON", include_in_web_ui=False,
                   help="also write the verdict and throughput here (for sweeps)")


def _parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        mix[name.strip()] = float(weight or 1)
    return mix


class _State:
    """What the users and the listeners share for one run (per locust process)."""

    def __init__(self) -> None:
        self.objectives: dict[str, Objective] = {}
        self.prompts: list[Prompt] = []
        self.loaded: tuple[str, str, int] | None = None
        self.active: set[str] = set()
        self.output_tokens: dict[str, int] = {}
        self.started = 0.0
        self.stopped = 0.0
        self.results: list[TierResult] = []

    def load(self, options: Any) -> None:
        key = (options.app_config, options.prompts, options.max_output_tokens)
        if key != self.loaded:
            cfg = Path(options.app_config)
            self.objectives = read_objectives(cfg if cfg.is_absolute() or cfg.exists() else ROOT / cfg)
            self.prompts = load_prompts(options.prompts or None, options.max_output_tokens)
            self.loaded = key


STATE = _State()


class TierUser(HttpUser):
    """A client of one tier: streams chat completions with that tier's key."""

    abstract = True
    tier = ""
    wait_time = between(0.05, 0.25)

    def on_start(self) -> None:
        self.key = os.environ.get(KEY_ENV.format(self.tier.upper()), "")
        self.rng = random.Random()

    @task
    def chat(self) -> None:
        opts = self.environment.parsed_options
        prompt = self.rng.choice(STATE.prompts)
        body = {
            "model": opts.model,
            "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": prompt.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if str(opts.ignore_eos).lower() in ("1", "true", "yes"):
            body["ignore_eos"] = True
        headers = {"Authorization": f"Bearer {self.key}"}
        t0 = time.perf_counter()
        ttft = None
        tokens = 0
        error = ""
        nbytes = 0
        with self.client.post(CHAT_PATH, json=body, headers=headers, stream=True,
                              catch_response=True, name=f"chat {self.tier}") as resp:
            if resp.status_code != 200:
                detail = resp.text[:200] if resp.status_code else repr(resp.error)[:200]
                resp.failure(f"HTTP {resp.status_code}: {detail}")
                return
            try:
                for line in resp.iter_lines():
                    nbytes += len(line) + 1
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = orjson.loads(line[6:])
                    if "error" in event:
                        error = str(event["error"].get("message", event["error"]))[:200]
                        break
                    choices = event.get("choices") or []
                    if ttft is None and any((c.get("delta") or {}).get("content") for c in choices):
                        ttft = (time.perf_counter() - t0) * 1000
                    if event.get("usage"):
                        tokens = int(event["usage"].get("completion_tokens") or 0)
            except Exception as exc:  # a broken stream is a failed request, not a crash
                error = f"stream broken: {exc.__class__.__name__}"
            e2e = (time.perf_counter() - t0) * 1000
            # The HTTP row shows the whole request, not just the time to the response headers.
            resp.request_meta["response_time"] = e2e
            resp.request_meta["response_length"] = nbytes
            if error or ttft is None:
                resp.failure(error or "stream ended without any content")
                return
            resp.success()
        fire = self.environment.events.request.fire
        fire(request_type=TTFT, name=self.tier, response_time=ttft, response_length=0,
             exception=None, context={})
        if tokens > 1:
            fire(request_type=TPOT, name=self.tier, response_time=(e2e - ttft) / (tokens - 1),
                 response_length=tokens, exception=None, context={})
        fire(request_type=E2E, name=self.tier, response_time=e2e, response_length=tokens,
             exception=None, context={})
        STATE.output_tokens[self.tier] = STATE.output_tokens.get(self.tier, 0) + tokens


class PremiumUser(TierUser):
    tier = "premium"


class StandardUser(TierUser):
    tier = "standard"


class BatchUser(TierUser):
    tier = "batch"


def _user_classes(environment: Environment) -> list[type[TierUser]]:
    return [c for c in environment.user_classes if issubclass(c, TierUser)]


@events.test_start.add_listener
def _on_start(environment: Environment, **_: Any) -> None:
    opts = environment.parsed_options
    assert opts is not None, "the locustfile runs under locust's command line"
    STATE.load(opts)
    mix = _parse_mix(opts.mix)
    STATE.active = set()
    for cls in _user_classes(environment):
        has_key = bool(os.environ.get(KEY_ENV.format(cls.tier.upper())))
        cls.weight = mix.get(cls.tier, 0) if has_key else 0
        if cls.weight > 0:
            STATE.active.add(cls.tier)
        elif mix.get(cls.tier) and not has_key:
            logger.warning("tier %s has no key (%s): no users", cls.tier, KEY_ENV.format(cls.tier.upper()))
    if not STATE.active:
        logger.error("no tier has both a weight in --mix and a key in SERVE_APP_KEY_<TIER>")
    STATE.output_tokens = {}
    STATE.results = []
    STATE.started = time.monotonic()
    STATE.stopped = 0.0


def _pct(environment: Environment, kind: str, tier: str, p: float) -> float | None:
    entry = environment.stats.entries.get((tier, kind))
    if entry is None or not entry.num_requests:
        return None
    return float(entry.get_response_time_percentile(p))


def _pct_all(environment: Environment, kind: str, p: float) -> float | None:
    """A percentile over every tier's samples together."""
    merged = StatsEntry(environment.stats, kind, "all", use_response_times_cache=False)
    for (name, method), entry in environment.stats.entries.items():
        if method == kind and name in STATE.active:
            merged.extend(entry)
    return float(merged.get_response_time_percentile(p)) if merged.num_requests else None


def tier_results(environment: Environment) -> list[TierResult]:
    """Each tier's p95s so far against its objectives (tiers with users, or all before a run)."""
    results = []
    tiers = [t for t in STATE.objectives if t in STATE.active] or list(STATE.objectives)
    for tier in tiers:
        obj = STATE.objectives[tier]
        http = environment.stats.entries.get((f"chat {tier}", "POST"))
        results.append(TierResult(
            tier=tier,
            requests=http.num_requests if http else 0,
            errors=http.num_failures if http else 0,
            ttft_p50_ms=_pct(environment, TTFT, tier, 0.5),
            ttft_p95_ms=_pct(environment, TTFT, tier, 0.95),
            tpot_p95_ms=_pct(environment, TPOT, tier, 0.95),
            e2e_p95_ms=_pct(environment, E2E, tier, 0.95),
            ttft_objective_ms=obj.ttft_p95_ms,
            tpot_objective_ms=obj.tpot_p95_ms,
            max_error_rate=environment.parsed_options.sla_max_error_rate
            if environment.parsed_options else 0.05,
        ))
    return results


@events.test_stop.add_listener
def _on_stop(environment: Environment, **_: Any) -> None:
    STATE.stopped = time.monotonic()
    STATE.results = [r for r in tier_results(environment) if r.tier in STATE.active]
    for r in STATE.results:
        print(r.line(), flush=True)
    ok = bool(STATE.results) and all(r.passed for r in STATE.results)
    print(f"SLA overall: {'PASS' if ok else 'FAIL'}", flush=True)
    path = environment.parsed_options.sla_json if environment.parsed_options else ""
    if path:
        elapsed = max(STATE.stopped - STATE.started, 1e-9)
        tokens = sum(STATE.output_tokens.values())
        Path(path).write_text(json.dumps({
            "passed": ok,
            "all": {f"{kind.lower()}_p{p}_ms": _pct_all(environment, kind, p / 100)
                    for kind in (TTFT, TPOT, E2E) for p in (50, 95)},
            "duration_s": elapsed,
            "output_tokens": tokens,
            "output_tokens_per_s": tokens / elapsed,
            "tiers": [r.as_dict() for r in STATE.results],
        }, indent=2))


@events.quitting.add_listener
def _on_quit(environment: Environment, **_: Any) -> None:
    if STATE.stopped:  # a run happened: its verdict decides the exit code
        ok = bool(STATE.results) and all(r.passed for r in STATE.results)
        environment.process_exit_code = 0 if ok else 1


# ---- the web UI's SLA tab -------------------------------------------------------------------
SLA_TAB = "sla"
_COLUMNS = [
    ("tier", "Tier"), ("status", "Verdict"), ("requests", "Requests"), ("errors", "Errors"),
    ("ttft", "TTFT p95 (ms)"), ("ttftobjective", "TTFT objective (ms)"),
    ("tpot", "TPOT p95 (ms)"), ("tpotobjective", "TPOT objective (ms)"), ("e2e", "E2E p95 (ms)"),
]


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def sla_rows(environment: Environment) -> list[dict[str, Any]]:
    return [
        {"tier": r.tier, "status": r.status, "requests": r.requests, "errors": r.errors,
         "ttft": _fmt(r.ttft_p95_ms), "ttftobjective": _fmt(r.ttft_objective_ms),
         "tpot": _fmt(r.tpot_p95_ms), "tpotobjective": _fmt(r.tpot_objective_ms),
         "e2e": _fmt(r.e2e_p95_ms)}
        for r in tier_results(environment)
    ]


@events.init.add_listener
def _on_init(environment: Environment, **_: Any) -> None:
    if environment.parsed_options is not None:
        STATE.load(environment.parsed_options)
    if not environment.web_ui:
        return
    web = environment.web_ui
    app = web.app
    assert app is not None  # locust creates the Flask app with the web UI
    web.template_args["extended_tabs"] = [{"title": "SLA", "key": SLA_TAB}]
    web.template_args["extended_tables"] = [
        {"key": SLA_TAB, "structure": [{"key": k, "title": t} for k, t in _COLUMNS]}
    ]

    @app.after_request
    def _extend_stats(response: Any) -> Any:
        # The UI polls /stats/requests; its "extended_stats" feed the extra tab's table.
        if flask_request.path != "/stats/requests" or response.status_code != 200:
            return response
        data = response.get_json()
        data["extended_stats"] = [{"key": SLA_TAB, "data": sla_rows(environment)}]
        response.set_data(json.dumps(data))
        return response

    @app.route("/sla")
    def _sla_json() -> Any:
        return {"tiers": [r.as_dict() for r in tier_results(environment)]}
