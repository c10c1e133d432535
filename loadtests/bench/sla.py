"""Do locust, an independent client and Prometheus tell the same SLA story? (issue 22)

``python -m loadtests.bench.sla --users 12,24 --duration 120`` starts the stack as a user does,
with ``serve-app run --prometheus`` (a Prometheus on 127.0.0.1 scraping Ray's metrics export),
one key per tier, and for each users level:

1. runs the README's locust example headless (``locust -f loadtests/locustfile.py --headless
   -u U -r 4 -t D``, the default mix premium=1,standard=2,batch=1), which prints a verdict per tier
   and writes its p95s (``--sla-json``);
2. at the same time, from this process: a light independent client (premium key, one streaming chat
   request every ``--client-interval`` s on a fixed schedule, prompts from ``loadtests/data``,
   ``max_tokens`` capped at ``--client-max-tokens``) timing the response head and the first content
   token of each request, and keeping the ``Server-Timing`` header; and a ``GET /health`` prober on
   the same schedule, which does no engine work and so shows the front end's own queueing;
3. after the load, once Ray's metrics agent (which exports every ~10 s) and Prometheus's scrape have
   caught up (``--export-delay``), asks Prometheus over the load's window: the gateway's TTFT and
   TPOT p95 per tier (``ray_serve_app_ttft_seconds``, ``_tpot_seconds``), the mean and p95 of each
   stage per tier (``ray_serve_app_stage_seconds``), vLLM's own TTFT p95, the CPU of the gateway
   and model replicas (``ray_serve_app_process_cpu_seconds_total``) and their event-loop lag.

Per tier the table puts side by side locust's p95 and verdict, the client's p95 (premium only),
Prometheus's p95 and its verdict against the tier's objectives (TTFT and TPOT, as locust judges),
and whether Prometheus agrees with the client and with locust: within 20 % of the other's value or
100 ms, whichever is larger (the issue's rule). The light client's requests are premium requests
too, so Prometheus's premium p95 covers both clients' requests.

Results: ``results/bench/sla-<timestamp>.{json,md}``, the markdown printed at the end. Every
request and subprocess is bounded in time; traffic goes to 127.0.0.1 only; the stack (and its
Prometheus) is stopped at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from dashboards.promql import PromQL
from loadtests.bench import procs
from loadtests.bench.procs import require_loopback, say
from loadtests.harness import stack as harness
from loadtests.harness.stack import ROOT, Stack
from loadtests.prompts import Prompt, load_prompts
from loadtests.sla import Objective, read_objectives

TIERS = ("premium", "standard", "batch")  # the locustfile's user classes
CLIENT_TIER = "premium"
MODEL = "tiny-chat"
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"
# The gateway's stages in request order (serve_app.gateway.accounting.timing.STAGES, which loadtests may not
# import); a stage Prometheus reports that is not listed here is shown after these.
STAGE_ORDER = ("front_door", "parse_auth", "admission", "queue", "handle", "engine", "relay")
# Agreement (issue 22): within 20 % of the reference or 100 ms, whichever is larger.
AGREE_REL, AGREE_FLOOR_MS = 0.20, 100.0
# Ray's metrics agent exports every ~10 s and `serve-app run --prometheus` scrapes every 5 s: after
# this long, everything a load did is in Prometheus.
EXPORT_DELAY_S = 25.0
# The window starts this much before the load, so that its first sample (the baseline that
# increase() subtracts) holds nothing of the load: one scrape interval.
WINDOW_LEAD_S = 5.0
REQUEST_TIMEOUT_S = 60.0  # one light-client request, head to last byte
HEALTH_TIMEOUT_S = 10.0
LOCUST_GRACE_S = 120.0  # locust's start-up and stop on top of -t
LOCUST_START_S = 90.0  # locust's imports, until it logs RAMP
RAMP = "Ramping to"  # locust's log line when it starts its users
PROMETHEUS_WAIT_S = 90.0
PROGRESS_EVERY_S = 15.0


# ---- pure parts ---------------------------------------------------------------------------------
def parse_users(text: str) -> list[int]:
    """``"12,24"`` -> ``[12, 24]``; each level must be a positive count."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    levels = [int(x) for x in parts if x.isdigit()]
    if not levels or len(levels) != len(parts) or any(u <= 0 for u in levels):
        raise argparse.ArgumentTypeError(f"--users wants positive counts like 12,24, not {text!r}")
    return levels


def parse_duration(text: str) -> int:
    """Seconds from ``120``, ``120s``, ``2m`` or ``1h``."""
    m = re.fullmatch(r"\s*(\d+)\s*([smh]?)\s*", text)
    if m is None or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"--duration wants e.g. 120, 120s or 2m, not {text!r}")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) with linear interpolation between order statistics; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, p50, p95 and max of latencies in ms (rounded to 0.1 ms)."""
    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 1)

    return {"n": len(values), "p50_ms": r(percentile(values, 0.5)), "p95_ms": r(percentile(values, 0.95)),
            "max_ms": r(max(values) if values else None)}


def agrees(value_ms: float | None, reference_ms: float | None, rel: float = AGREE_REL,
           floor_ms: float = AGREE_FLOOR_MS) -> bool | None:
    """Whether ``value_ms`` is within ``rel`` of ``reference_ms`` or ``floor_ms``, whichever is
    larger; None when either is missing."""
    if value_ms is None or reference_ms is None:
        return None
    return abs(value_ms - reference_ms) <= max(rel * abs(reference_ms), floor_ms)


def quantile_interval(values: Sequence[float], q: float,
                      confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the ``q`` quantile of the population a sample
    came from: order statistics ``[x(r), x(s)]`` with the number of samples below the quantile
    ~ Binomial(n, q) (capped at the sample's min and max); None if empty. A small sample's p95 is
    uncertain: 47 requests put it between the 42nd and the largest."""
    if not values:
        return None
    xs = sorted(values)
    n = len(xs)
    alpha = (1.0 - confidence) / 2

    def cdf(k: int) -> float:  # P(B <= k)
        return sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(0, k + 1))

    r = max((k for k in range(1, n + 1) if cdf(k - 1) <= alpha), default=1)  # P(B < r) <= alpha
    s = min((k for k in range(1, n + 1) if 1.0 - cdf(k - 1) <= alpha), default=n)  # P(B >= s) <= alpha
    return xs[r - 1], xs[s - 1]


def agrees_with_sample(value_ms: float | None, sample_ms: Sequence[float], q: float = 0.95,
                       rel: float = AGREE_REL, floor_ms: float = AGREE_FLOOR_MS) -> bool | None:
    """Whether ``value_ms`` (a quantile measured over every request, e.g. Prometheus's) agrees with
    a sample of the requests: within ``agrees``'s tolerance of the sample's confidence interval
    for that quantile; None when either is missing."""
    interval = quantile_interval(sample_ms, q)
    if value_ms is None or interval is None:
        return None
    lo, hi = interval
    return bool(agrees(value_ms, lo, rel, floor_ms) or agrees(value_ms, hi, rel, floor_ms)
                or lo <= value_ms <= hi)


def verdict(ttft_p95_ms: float | None, tpot_p95_ms: float | None, objective: Objective) -> str:
    """PASS / FAIL against a tier's objectives as locust judges them (TTFT and TPOT p95), or NO DATA."""
    if ttft_p95_ms is None or tpot_p95_ms is None:
        return "NO DATA"
    ok = ttft_p95_ms <= objective.ttft_p95_ms and tpot_p95_ms <= objective.tpot_p95_ms
    return "PASS" if ok else "FAIL"


def window_seconds(t_start: float, at: float, lead_s: float = WINDOW_LEAD_S) -> int:
    """The range (whole seconds) of a query evaluated at ``at`` that covers the load from
    ``t_start`` on, plus ``lead_s`` before it for the baseline sample."""
    if at <= t_start:
        raise ValueError(f"the query time {at} is not after the load's start {t_start}")
    return math.ceil(at - t_start + lead_s)


def _selector(metric: str, window_s: int, **labels: str) -> str:
    """``metric{a="b"}[60s]`` (no braces without labels)."""
    matchers = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{metric}{{{matchers}}}[{window_s}s]" if matchers else f"{metric}[{window_s}s]"


def quantile_expr(metric: str, window_s: int, by: Sequence[str], q: float = 0.95, **labels: str) -> str:
    """``histogram_quantile`` of a histogram over the window, one series per ``by`` labels."""
    keep = ", ".join(["le", *by])
    return (f"histogram_quantile({q:g}, sum by ({keep}) "
            f"(rate({_selector(metric + '_bucket', window_s, **labels)})))")


def mean_expr(metric: str, window_s: int, by: Sequence[str], **labels: str) -> str:
    """A histogram's mean over the window (increase of the sum over increase of the count)."""
    keep = ", ".join(by)
    return (f"sum by ({keep}) (increase({_selector(metric + '_sum', window_s, **labels)})) / "
            f"sum by ({keep}) (increase({_selector(metric + '_count', window_s, **labels)}))")


@dataclass(frozen=True)
class Queries:
    """Every PromQL expression the benchmark asks, for one window."""

    window_s: int
    model: str = MODEL

    @property
    def ttft_p95(self) -> str:
        return quantile_expr("ray_serve_app_ttft_seconds", self.window_s, ["tier"], model=self.model)

    @property
    def tpot_p95(self) -> str:
        return quantile_expr("ray_serve_app_tpot_seconds", self.window_s, ["tier"], model=self.model)

    @property
    def requests(self) -> str:
        sel = _selector("ray_serve_app_ttft_seconds_count", self.window_s, model=self.model)
        return f"sum by (tier) (increase({sel}))"

    @property
    def stage_mean(self) -> str:
        return mean_expr("ray_serve_app_stage_seconds", self.window_s, ["tier", "stage"], model=self.model)

    @property
    def stage_p95(self) -> str:
        return quantile_expr("ray_serve_app_stage_seconds", self.window_s, ["tier", "stage"],
                             model=self.model)

    @property
    def vllm_ttft_p95(self) -> str:
        return quantile_expr("ray_vllm_time_to_first_token_seconds", self.window_s, ["model_name"])

    @property
    def cpu_seconds(self) -> str:
        sel = _selector("ray_serve_app_process_cpu_seconds_total", self.window_s)
        return f"sum by (kind, deployment) (increase({sel}))"

    @property
    def loop_lag_max(self) -> str:
        sel = _selector("ray_serve_app_event_loop_lag_seconds", self.window_s)
        return f"max by (kind, deployment) (max_over_time({sel}))"

    @property
    def completion_tokens(self) -> str:
        return f"sum(increase({_selector('ray_serve_app_tokens_total', self.window_s, type='completion')}))"


def parse_server_timing(value: str) -> dict[str, float]:
    """``front_door;dur=1.2, parse_auth;dur=0.3`` -> ``{"front_door": 1.2, "parse_auth": 0.3}``
    (ms); entries without a duration are left out."""
    out: dict[str, float] = {}
    for entry in value.split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        for p in params:
            key, _, raw = p.partition("=")
            if name and key.strip().lower() == "dur":
                try:
                    out[name] = float(raw.strip().strip('"'))
                except ValueError:
                    pass
    return out


def ordered_stages(stages: Sequence[str]) -> list[str]:
    """Stages in request order, unknown ones (alphabetically) after the known ones."""
    known = [s for s in STAGE_ORDER if s in stages]
    return known + sorted(set(stages) - set(STAGE_ORDER))


def _ms(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _yn(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def tier_rows(level: Mapping[str, Any], objectives: Mapping[str, Objective]) -> list[dict[str, Any]]:
    """One row per tier of a users level: each source's p95, the verdicts and the agreements."""
    locust = {t["tier"]: t for t in (level.get("locust") or {}).get("tiers", [])}
    prom = level.get("prometheus") or {}
    client_p95 = (level.get("client") or {}).get("ttft", {}).get("p95_ms")
    rows = []
    for tier in (t for t in TIERS if t in objectives):
        lt = locust.get(tier, {})
        p_ttft = (prom.get("ttft_p95_ms") or {}).get(tier)
        p_tpot = (prom.get("tpot_p95_ms") or {}).get(tier)
        p_verdict = verdict(p_ttft, p_tpot, objectives[tier])
        l_verdict = lt.get("status", "NO DATA")
        c_p95 = client_p95 if tier == CLIENT_TIER else None
        rows.append({
            "tier": tier, "ttft_objective_ms": objectives[tier].ttft_p95_ms,
            "tpot_objective_ms": objectives[tier].tpot_p95_ms,
            "locust_requests": lt.get("requests"), "locust_errors": lt.get("errors"),
            "locust_ttft_p95_ms": lt.get("ttft_p95_ms"), "locust_tpot_p95_ms": lt.get("tpot_p95_ms"),
            "locust_verdict": l_verdict, "client_ttft_p95_ms": c_p95,
            "prom_requests": (prom.get("requests") or {}).get(tier),
            "prom_ttft_p95_ms": p_ttft, "prom_tpot_p95_ms": p_tpot, "prom_verdict": p_verdict,
            "prom_vs_client": agrees(p_ttft, c_p95),
            "prom_vs_locust": agrees(p_ttft, lt.get("ttft_p95_ms")),
            "verdicts_equal": None if "NO DATA" in (p_verdict, l_verdict) else p_verdict == l_verdict,
        })
    return rows


def level_markdown(level: Mapping[str, Any], objectives: Mapping[str, Objective]) -> list[str]:
    users, duration = level["users"], level["duration_s"]
    lines = [f"### -u {users} -r {level['spawn_rate']}, {duration} s (Prometheus window "
             f"{level.get('window_s', '-')} s)", "",
             "TTFT p95 in ms from each source; verdicts against the tier's objectives (TTFT and TPOT p95); "
             f"agreement: within {AGREE_REL:.0%} or {AGREE_FLOOR_MS:.0f} ms, whichever is larger.", "",
             "| Tier | objective | locust p95 | locust verdict | client p95 | Prometheus p95 "
             "| Prometheus TPOT p95 | Prometheus verdict | Prom ~ client | Prom ~ locust | verdicts equal "
             "| requests (locust / Prom) |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | --- | --- | ---: |"]
    for r in level.get("rows") or tier_rows(level, objectives):
        lines.append(
            f"| {r['tier']} | {r['ttft_objective_ms']:.0f} / {r['tpot_objective_ms']:.0f} "
            f"| {_ms(r['locust_ttft_p95_ms'])} | {r['locust_verdict']} | {_ms(r['client_ttft_p95_ms'])} "
            f"| {_ms(r['prom_ttft_p95_ms'])} | {_ms(r['prom_tpot_p95_ms'])} | {r['prom_verdict']} "
            f"| {_yn(r['prom_vs_client'])} | {_yn(r['prom_vs_locust'])} | {_yn(r['verdicts_equal'])} "
            f"| {r['locust_requests'] if r['locust_requests'] is not None else '-'} / "
            f"{_ms(r['prom_requests'])} |")
    locust = level.get("locust") or {}
    if locust.get("duration_s") is not None:
        lines += ["", f"Locust ran {locust['duration_s']:.0f} s (exit {level.get('locust_exit')}), "
                      f"{locust.get('output_tokens_per_s', 0):.0f} output tokens/s."]
    client, health = level.get("client") or {}, level.get("health") or {}
    ct, ch = client.get("ttft") or {}, client.get("head") or {}
    lines += ["",
              f"Light client ({CLIENT_TIER}, one streaming request every {level['client_interval_s']:g} s): "
              f"{ct.get('n', 0)} requests, {client.get('errors', 0)} errors; first content token "
              f"p50 {_ms(ct.get('p50_ms'))} / p95 {_ms(ct.get('p95_ms'))} / max {_ms(ct.get('max_ms'))} ms; "
              f"response head p95 {_ms(ch.get('p95_ms'))} ms.",
              f"`GET /health` every {level['client_interval_s']:g} s: {health.get('n', 0)} probes, "
              f"{health.get('errors', 0)} errors; p50 {_ms(health.get('p50_ms'))} / "
              f"p95 {_ms(health.get('p95_ms'))} / max {_ms(health.get('max_ms'))} ms."]
    prom = level.get("prometheus") or {}
    vllm = prom.get("vllm_ttft_p95_ms") or {}
    if vllm:
        lines.append("vLLM's own TTFT p95 (`ray_vllm_time_to_first_token_seconds`): "
                     + ", ".join(f"{m} {_ms(v)} ms" for m, v in sorted(vllm.items())) + ".")
    lines += ["", *stage_markdown(prom.get("stage_mean_ms") or {}, prom.get("stage_p95_ms") or {},
                                  client.get("server_timing_mean_ms") or {})]
    lines += ["", *cpu_markdown(prom, duration)]
    return lines


def stage_markdown(mean: Mapping[str, Mapping[str, float]], p95: Mapping[str, Mapping[str, float]],
                   client_mean: Mapping[str, float]) -> list[str]:
    """Where the time goes: mean (p95) ms per stage and tier from Prometheus, plus the light
    client's mean of its Server-Timing header (premium)."""
    stages = ordered_stages(sorted({s for per in mean.values() for s in per} | set(client_mean)
                                   - {"total"}))
    if not stages:
        return ["Stages: no data from `ray_serve_app_stage_seconds`."]
    lines = ["Where the time goes, ms per stage: mean (p95) from `ray_serve_app_stage_seconds`; "
             "the sum of the means is the mean time to the first byte.", "",
             "| Tier | " + " | ".join(stages) + " | sum of means |",
             "| --- | " + " | ".join("---:" for _ in stages) + " | ---: |"]
    for tier in (t for t in TIERS if t in mean):
        cells = [f"{_ms(mean[tier].get(s), 1)} ({_ms(p95.get(tier, {}).get(s), 0)})" for s in stages]
        total = sum(v for s, v in mean[tier].items() if s in stages)
        lines.append(f"| {tier} | " + " | ".join(cells) + f" | {total:.1f} |")
    if client_mean:
        cells = [_ms(client_mean.get(s), 1) for s in stages]
        total = sum(v for s, v in client_mean.items() if s in stages)
        lines.append(f"| {CLIENT_TIER}, client's Server-Timing (mean) | " + " | ".join(cells)
                     + f" | {total:.1f} |")
    return lines


def cpu_markdown(prom: Mapping[str, Any], duration_s: float) -> list[str]:
    """CPU of each replica kind over the window, as cores over the load's duration."""
    cpu: Mapping[str, float] = prom.get("cpu_seconds") or {}
    if not cpu:
        return ["CPU: no `ray_serve_app_process_cpu_seconds_total` series."]
    lag: Mapping[str, float] = prom.get("loop_lag_max_ms") or {}
    lines = ["CPU from `ray_serve_app_process_cpu_seconds_total` over the window (cores: CPU seconds "
             "over the load's duration; the window's idle tail adds a little):", "",
             "| Process (kind / deployment) | CPU s | cores | max event-loop lag ms |",
             "| --- | ---: | ---: | ---: |"]
    for who in sorted(cpu):
        lines.append(f"| {who} | {cpu[who]:.1f} | {cpu[who] / duration_s:.2f} | {_ms(lag.get(who))} |")
    tokens = prom.get("completion_tokens")
    gateway = sum(v for who, v in cpu.items() if who.startswith("gateway"))
    if tokens and gateway:
        lines += ["", f"Gateway CPU per 1,000 completion tokens: {1000 * gateway / tokens:.2f} s "
                      f"({tokens:.0f} tokens)."]
    return lines


def markdown(doc: Mapping[str, Any]) -> str:
    objectives = {t: Objective(**o) for t, o in doc["objectives"].items()}
    lines = [f"Command: `{doc['command']}`", "",
             f"Config {doc['config']}; locust mix premium=1,standard=2,batch=1 (the locustfile's default), "
             f"model {MODEL}; Prometheus queried {doc['export_delay_s']:g} s after each load; "
             f"clients at niceness {doc.get('client_nice', 0)}.", ""]
    for level in doc["levels"]:
        lines += [*level_markdown(level, objectives), ""]
    return "\n".join(lines).rstrip() + "\n"


# ---- the light client and the /health prober ------------------------------------------------------
@dataclass
class ClientLog:
    """What the light client and the prober measured (ms)."""

    head: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    health: list[float] = field(default_factory=list)
    errors: int = 0
    health_errors: int = 0
    server_timing: list[dict[str, float]] = field(default_factory=list)
    last_error: str = ""

    def result(self) -> dict[str, Any]:
        stages = sorted({s for st in self.server_timing for s in st})
        st_mean = {s: round(sum(v) / len(v), 2) for s in stages
                   if (v := [st[s] for st in self.server_timing if s in st])}
        return {"ttft": summary(self.ttft), "head": summary(self.head), "errors": self.errors,
                "last_error": self.last_error, "server_timing_mean_ms": st_mean}

    def health_result(self) -> dict[str, Any]:
        return {**summary(self.health), "errors": self.health_errors}


async def chat_once(client: httpx.AsyncClient, url: str, key: str, prompt: Prompt, max_tokens: int,
                    log: ClientLog) -> None:
    """One streaming chat request: the time to its response head and to its first content token."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": min(prompt.max_tokens, max_tokens), "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        head = (time.perf_counter() - t0) * 1000
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        timing = parse_server_timing(r.headers.get("server-timing", ""))
        ttft = None
        async for line in r.aiter_lines():
            if ttft is not None or not line.startswith("data: {"):
                continue  # read to the end: the stream is the whole request
            event = orjson.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {str(event['error'])[:200]}")
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                ttft = (time.perf_counter() - t0) * 1000
    if ttft is None:
        raise RuntimeError("stream ended without any content")
    log.head.append(head)
    log.ttft.append(ttft)
    log.server_timing.append(timing)


async def health_once(client: httpx.AsyncClient, url: str, log: ClientLog) -> None:
    t0 = time.perf_counter()
    r = await client.get(url)
    if r.status_code != 200:
        raise RuntimeError(f"/health: HTTP {r.status_code}")
    log.health.append((time.perf_counter() - t0) * 1000)


async def every(interval_s: float, stop: asyncio.Event, make: Callable[[], Awaitable[None]],
                timeout_s: float, on_error: Callable[[BaseException], None]) -> None:
    """Start ``make()`` every ``interval_s`` on a fixed schedule (open loop: a slow answer does not
    delay the next request), each bounded by ``timeout_s``, until ``stop``; then wait for those
    still running (they are bounded too)."""
    async def bounded() -> None:
        try:
            await asyncio.wait_for(make(), timeout_s)
        except Exception as exc:  # a failed request is counted, not fatal
            on_error(exc)

    tasks: set[asyncio.Task[None]] = set()
    t0 = time.monotonic()
    i = 0
    while not stop.is_set():
        task = asyncio.create_task(bounded())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
        delay = t0 + i * interval_s - time.monotonic()
        try:
            await asyncio.wait_for(stop.wait(), max(delay, 0.0))
        except TimeoutError:
            pass
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s + 5)


# ---- one users level ----------------------------------------------------------------------------
@dataclass
class Setup:
    stack: Stack
    prom: PromQL
    keys: dict[str, str]  # tier -> secret
    objectives: dict[str, Objective]
    prompts: list[Prompt]
    ns: argparse.Namespace
    workdir: Path


def locust_argv(stack: Stack, users: int, spawn_rate: int, duration_s: int, sla_json: Path) -> list[str]:
    """The README's example (headless, -u, -r, -t) against this stack, writing its verdict JSON."""
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", stack.root_url,
            "--headless", "-u", str(users), "-r", str(spawn_rate), "-t", f"{duration_s}s",
            "--only-summary", "--app-config", str(stack.config), "--sla-json", str(sla_json)]


async def drive(s: Setup, users: int, log: ClientLog) -> dict[str, Any]:
    """Locust in a subprocess and, while it runs, the light client and the prober; returns the
    load's wall-clock start and end and locust's result."""
    ns = s.ns
    sla_json = s.workdir / f"locust-u{users}.json"
    sla_json.unlink(missing_ok=True)
    env = {**os.environ, **{f"SERVE_APP_KEY_{t.upper()}": k for t, k in s.keys.items()}}
    stop = asyncio.Event()
    rng = random.Random(users)
    chat_url, health_url = f"{s.stack.base_url}/chat/completions", f"{s.stack.root_url}/health"

    def failed(kind: str) -> Callable[[BaseException], None]:
        def note(exc: BaseException) -> None:
            if kind == "health":
                log.health_errors += 1
            else:
                log.errors += 1
                log.last_error = f"{exc.__class__.__name__}: {exc}"[:300]
        return note

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as chat, \
            httpx.AsyncClient(timeout=httpx.Timeout(HEALTH_TIMEOUT_S), limits=limits) as probe:
        proc = harness.spawn(f"locust -u {users}", locust_argv(s.stack, users, ns.spawn_rate, ns.duration,
                                                               sla_json),
                             s.workdir / f"locust-u{users}.log", env=env)
        # The load starts when locust starts its users, seconds after the process (imports).
        ramp_deadline = time.monotonic() + LOCUST_START_S
        while proc.alive() and time.monotonic() < ramp_deadline and RAMP not in proc.log_tail(20_000):
            await asyncio.sleep(0.2)
        t_start = time.time()
        say(f"-u {users}: locust pid {proc.pid} started its users for {ns.duration} s; light client and "
            f"/health prober every {ns.client_interval:g} s")
        workers = [
            asyncio.create_task(every(ns.client_interval, stop, lambda: chat_once(
                chat, chat_url, s.keys[CLIENT_TIER], rng.choice(s.prompts), ns.client_max_tokens, log),
                REQUEST_TIMEOUT_S, failed("chat"))),
            asyncio.create_task(every(ns.client_interval, stop, lambda: health_once(probe, health_url, log),
                                      HEALTH_TIMEOUT_S, failed("health"))),
        ]
        deadline = time.monotonic() + ns.duration + LOCUST_GRACE_S
        last = time.monotonic()
        try:
            while proc.alive():
                if time.monotonic() > deadline:
                    say(f"locust still running {LOCUST_GRACE_S:.0f} s after -t: stopping it")
                    break
                await asyncio.sleep(0.5)
                if time.monotonic() - last >= PROGRESS_EVERY_S:
                    last = time.monotonic()
                    say(f"  -u {users}: {time.time() - t_start:.0f}/{ns.duration} s; client n={len(log.ttft)} "
                        f"errors={log.errors} ttft p95={_ms(percentile(log.ttft, 0.95))} ms; /health "
                        f"p95={_ms(percentile(log.health, 0.95))} ms")
        finally:
            t_end = time.time()
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
            harness.stop(proc, timeout_s=30, say=say)  # a no-op once it has exited
    for line in proc.log_tail(20_000).splitlines():
        if line.startswith("SLA "):
            say(f"  locust: {line}")
    locust = json.loads(sla_json.read_text()) if sla_json.exists() else {}
    if not locust:
        say(f"locust wrote no verdict (exit {proc.popen.returncode}); log tail:\n{proc.log_tail(2000)}")
    return {"t_start": t_start, "t_end": t_end, "locust": locust, "locust_exit": proc.popen.returncode}


def by_label(result: list[dict[str, Any]], *labels: str, scale: float = 1.0) -> dict[str, float]:
    """An instant vector as ``{"a / b": value * scale}`` keyed by ``labels``; NaN and inf left out."""
    out = {}
    for series in result:
        v = float(series["value"][1])
        if math.isfinite(v):
            out[" / ".join(series["metric"].get(lb, "") for lb in labels)] = v * scale
    return out


def nested(flat: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """``{"premium / engine": v}`` -> ``{"premium": {"engine": v}}`` (rounded to 0.01)."""
    out: dict[str, dict[str, float]] = {}
    for k, v in flat.items():
        a, _, b = k.partition(" / ")
        out.setdefault(a, {})[b] = round(v, 2)
    return out


def ask_prometheus(prom: PromQL, window_s: int, at: float) -> dict[str, Any]:
    q = Queries(window_s)

    def ask(expr: str, *labels: str, scale: float = 1.0) -> dict[str, float]:
        try:
            return by_label(prom.query(expr, at=at), *labels, scale=scale)
        except Exception as exc:  # one failed query leaves a gap, not a crash
            say(f"prometheus: {expr}: {exc}")
            return {}

    tokens = ask(q.completion_tokens)
    return {
        "queries": {name: getattr(q, name) for name in ("ttft_p95", "tpot_p95", "requests", "stage_mean",
                                                        "stage_p95", "vllm_ttft_p95", "cpu_seconds",
                                                        "loop_lag_max", "completion_tokens")},
        "ttft_p95_ms": ask(q.ttft_p95, "tier", scale=1000),
        "tpot_p95_ms": ask(q.tpot_p95, "tier", scale=1000),
        "requests": ask(q.requests, "tier"),
        "stage_mean_ms": nested(ask(q.stage_mean, "tier", "stage", scale=1000)),
        "stage_p95_ms": nested(ask(q.stage_p95, "tier", "stage", scale=1000)),
        "vllm_ttft_p95_ms": ask(q.vllm_ttft_p95, "model_name", scale=1000),
        "cpu_seconds": ask(q.cpu_seconds, "kind", "deployment"),
        "loop_lag_max_ms": ask(q.loop_lag_max, "kind", "deployment", scale=1000),
        "completion_tokens": next(iter(tokens.values()), None),
    }


def run_level(s: Setup, users: int) -> dict[str, Any]:
    log = ClientLog()
    load = asyncio.run(drive(s, users, log))
    say(f"-u {users}: load done; waiting {s.ns.export_delay:g} s for Ray's export and the scrape")
    time.sleep(s.ns.export_delay)
    at = time.time()
    window = window_seconds(load["t_start"], at)
    prom = ask_prometheus(s.prom, window, at)
    level = {"users": users, "spawn_rate": s.ns.spawn_rate, "duration_s": s.ns.duration,
             "client_interval_s": s.ns.client_interval, "client_max_tokens": s.ns.client_max_tokens,
             **load, "at": at, "window_s": window, "client": log.result(), "health": log.health_result(),
             "prometheus": prom}
    level["rows"] = tier_rows(level, s.objectives)
    for r in level["rows"]:
        say(f"  {r['tier']}: locust {_ms(r['locust_ttft_p95_ms'])} ms {r['locust_verdict']}, client "
            f"{_ms(r['client_ttft_p95_ms'])} ms, Prometheus {_ms(r['prom_ttft_p95_ms'])} ms {r['prom_verdict']}")
    return level


# ---- setting up ---------------------------------------------------------------------------------
def prometheus_url(stack: Stack, timeout_s: float = PROMETHEUS_WAIT_S) -> str:
    """The URL ``serve-app run --prometheus`` prints (``PROMETHEUS_URL=...``) once the app is
    ready, after its Prometheus answers; checked to be loopback."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(r"^PROMETHEUS_URL=(\S+)$", stack.proc.log_tail(200_000), re.M)
        if m:
            require_loopback(m.group(1))
            return m.group(1)
        if not stack.proc.alive():
            raise harness.ProcExited(stack.proc, "Prometheus")
        time.sleep(0.5)
    raise harness.StackError(f"no PROMETHEUS_URL in {stack.log} after {timeout_s:.0f} s:\n"
                             f"{stack.proc.log_tail(2000)}")


def wait_targets_up(prom: PromQL, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            targets = prom.targets()
        except OSError:
            targets = []
        if targets and all(t.get("health") == "up" for t in targets):
            return len(targets)
        if time.monotonic() > deadline:
            raise harness.StackError(f"Prometheus's targets are not up after {timeout_s:.0f} s: {targets}")
        time.sleep(1)


def warm_up(s: Setup) -> None:
    """One small streaming request per tier, so that every series exists (and has a sample) before
    the first window opens: increase() cannot count a series' first sample."""
    async def go() -> None:
        log = ClientLog()
        async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as c:
            for tier in TIERS:
                for _ in range(2):
                    await asyncio.wait_for(chat_once(c, f"{s.stack.base_url}/chat/completions", s.keys[tier],
                                                     s.prompts[0], 4, log), REQUEST_TIMEOUT_S)
            await asyncio.wait_for(health_once(c, f"{s.stack.root_url}/health", log), HEALTH_TIMEOUT_S)
        say(f"warm-up: {len(log.ttft)} requests, first token ms {[round(x) for x in log.ttft]}")

    asyncio.run(go())
    say(f"waiting {s.ns.export_delay:g} s so that the warm-up is exported before the first window")
    time.sleep(s.ns.export_delay)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.sla", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--users", type=parse_users, default=[12], help="locust users per level, e.g. 12,24")
    p.add_argument("--duration", type=parse_duration, default=120, help="each level's locust -t (120, 2m)")
    p.add_argument("--spawn-rate", type=int, default=4, help="locust -r")
    p.add_argument("--client-interval", type=float, default=0.5,
                   help="seconds between the light client's requests (and /health probes)")
    p.add_argument("--client-max-tokens", type=int, default=16, help="cap on the light client's max_tokens")
    p.add_argument("--export-delay", type=float, default=EXPORT_DELAY_S,
                   help="seconds to wait after a load before asking Prometheus")
    p.add_argument("--client-nice", type=int, default=0,
                   help="niceness of the clients (locust, the light client, the prober), set once the "
                        "stack is up so the stack keeps its own; e.g. -10 puts them ahead of every stack "
                        "process (negative values need root)")
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if shutil.which("prometheus") is None:
        raise SystemExit("prometheus is not installed (sudo bash scripts/system-deps.sh installs it)")
    run = procs.new_run("sla", "loadtests.bench.sla", ns.config, ns.results_dir, argv)
    config, base, stamp, command = run.config, run.base, run.stamp, run.command
    objectives = {t: o for t, o in read_objectives(config).items() if t in TIERS}
    missing = [t for t in TIERS if t not in objectives]
    if missing:
        raise SystemExit(f"{config}: the locustfile's tiers {missing} are not in the config's tiers")
    prompts = load_prompts()
    workdir = Path(tempfile.mkdtemp(prefix="serve-app-sla-"))
    # SIGTERM (a timeout, a CI cancel) takes the same way out as Ctrl-C: the finally below.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    stack = harness.start_stack(config, workdir, keys={f"sla-{t}": (t, ["*"]) for t in TIERS},
                                run_args=["--prometheus"], retries=1, say=say)
    levels: list[dict[str, Any]] = []
    try:
        require_loopback(stack.base_url)
        prom = PromQL(prometheus_url(stack))
        say(f"Prometheus at {prom.url}: {wait_targets_up(prom)} target(s) up")
        if ns.client_nice:
            # This thread's niceness, inherited by the client threads and the locust process started
            # after it; the stack's processes, started before, keep theirs.
            os.setpriority(os.PRIO_PROCESS, 0, ns.client_nice)
            say(f"clients run at niceness {os.getpriority(os.PRIO_PROCESS, 0)}")
        s = Setup(stack=stack, prom=prom, keys={t: stack.keys[f"sla-{t}"] for t in TIERS},
                  objectives=objectives, prompts=prompts, ns=ns, workdir=workdir)
        warm_up(s)
        for users in ns.users:
            levels.append(run_level(s, users))
    finally:
        stack.stop(say=say)
        doc = {"command": command, "timestamp": stamp, "config": str(ns.config),
               "export_delay_s": ns.export_delay, "client_nice": ns.client_nice,
               "objectives": {t: {"ttft_p95_ms": o.ttft_p95_ms, "tpot_p95_ms": o.tpot_p95_ms,
                                  "priority": o.priority} for t, o in objectives.items()},
               "levels": levels, "workdir": str(workdir)}
        if levels:
            md = markdown(doc)
            procs.write_results(base, doc, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
