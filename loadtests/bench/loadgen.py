"""Closed-loop streaming chat users spread over several worker processes (the flow benchmark's load).

One Python process with httpx could not drive 128-256 streaming users on a 2-core machine: the flow
benchmark's first runs saw premium's slowest answers leave the gateway in 0.2-0.5 s and reach the
client 3.7-9.9 s later (Server-Timing ``total`` against the client's own clock), the time the
generator's one event loop took to get to them. Here each worker process runs its share of the
users on its own event loop with aiohttp (what vLLM's own benchmark uses; it reads a stream with
less CPU per chunk than httpx), so the client's clock measures the stack, not the generator.

Users are dealt to the workers round-robin, so every worker holds a slice of every group. Each
worker runs until the same deadline (``time.monotonic`` is one clock for every process on the
machine), then reads its running requests to their end (bounded by ``REQUEST_TIMEOUT_S``).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from loadtests.bench.sla import parse_server_timing
from loadtests.prompts import Prompt

REQUEST_TIMEOUT_S = 120.0


@dataclass
class Sample:
    """One request as the client saw it."""

    key: str
    tier: str
    start: float
    end: float
    status: int  # 0: no answer (timeout, connection error)
    ttft_ms: float | None = None
    tokens: int = 0
    # The gateway's Server-Timing at the head (stage -> ms, ``total`` among them), and the client's
    # own time to the head: where a slow first token waited.
    stages: dict[str, float] = field(default_factory=dict)
    head_ms: float | None = None
    reason: str | None = None  # a refusal's error message, cut at its first digit (no counts)


@dataclass(frozen=True)
class Users:
    """``count`` closed-loop users on one key."""

    key: str
    secret: str
    tier: str
    count: int


@dataclass(frozen=True)
class Load:
    """What every worker is told: where, with which prompts, and how."""

    base_url: str
    model: str
    prompts: tuple[Prompt, ...]
    max_tokens: int
    backoff_s: float
    stop_at: float  # time.monotonic()
    seed: int
    ramp_s: float = 0.0  # each user's first request waits a random share of this (0: all at once)


def refusal_reason(body: bytes) -> str:
    """An error answer's message up to its first digit, so that refusals group by their kind
    ("model 'tiny-chat' is busy: the request waited ", not the seconds that follow)."""
    try:
        message = str(orjson.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:60].decode("utf-8", "replace")
    cut = next((i for i, ch in enumerate(message) if ch.isdigit()), len(message))
    return message[:cut].strip()


def deal(groups: Sequence[Users], workers: int) -> list[list[tuple[Users, int]]]:
    """Every user of ``groups`` (with its global index) dealt round-robin to ``workers`` shares;
    empty shares are dropped."""
    users = [(g, i) for i, g in enumerate(g for g in groups for _ in range(g.count))]
    shares = [users[w::max(1, workers)] for w in range(max(1, workers))]
    return [s for s in shares if s]


async def stream_once(session: aiohttp.ClientSession, load: Load, u: Users, prompt: Prompt) -> Sample:
    """One streaming chat request: its status, time to the first content token, output tokens."""
    body = {"model": load.model, "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": min(prompt.max_tokens, load.max_tokens), "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {u.secret}", "Content-Type": "application/json"}
    t0 = time.perf_counter()
    s = Sample(u.key, u.tier, time.monotonic(), 0.0, 0)
    try:
        async with session.post(f"{load.base_url}/chat/completions", data=orjson.dumps(body),
                                headers=headers) as r:
            s.status = r.status
            s.head_ms = (time.perf_counter() - t0) * 1000
            s.stages = parse_server_timing(r.headers.get("server-timing", ""))
            if r.status == 200:
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = orjson.loads(line[6:])
                    if "error" in event:
                        s.status = 0
                        break
                    if s.ttft_ms is None and any((c.get("delta") or {}).get("content")
                                                 for c in event.get("choices") or []):
                        s.ttft_ms = (time.perf_counter() - t0) * 1000
                    usage = event.get("usage")
                    if usage:
                        s.tokens = int(usage.get("completion_tokens") or 0)
            else:
                s.reason = refusal_reason(await r.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        s.status = 0
    s.end = time.monotonic()
    return s


async def _share(load: Load, share: Sequence[tuple[Users, int]]) -> list[Sample]:
    samples: list[Sample] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)

    async def user(session: aiohttp.ClientSession, u: Users, i: int) -> None:
        rng = random.Random(load.seed * 7919 + i)
        if load.ramp_s > 0:  # users that start together finish in waves; spread their starts
            await asyncio.sleep(rng.uniform(0.0, load.ramp_s))
        while time.monotonic() < load.stop_at:
            t = time.monotonic()
            try:
                s = await asyncio.wait_for(stream_once(session, load, u, rng.choice(load.prompts)),
                                           REQUEST_TIMEOUT_S + 5)
            except TimeoutError:
                s = Sample(u.key, u.tier, t, time.monotonic(), 0)
            samples.append(s)
            if s.status != 200:
                await asyncio.sleep(load.backoff_s)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(user(session, u, i) for u, i in share), return_exceptions=True)
    return samples


def run_share(load: Load, share: Sequence[tuple[Users, int]]) -> list[Sample]:
    """One worker's users, to the deadline (the worker processes' entry point)."""
    return asyncio.run(_share(load, share))


def _ready(_: int) -> bool:
    return True


class LoadGen:
    """``workers`` processes that run closed-loop users (``run``); ``workers`` 1 runs them here."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, not {workers}")
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        if workers > 1:
            # spawn, not fork: the benchmark's own process holds threads (the stack's log readers).
            self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
            list(self._pool.map(_ready, range(workers)))  # started and imported before any clock runs

    def run(self, base_url: str, model: str, groups: Sequence[Users], duration_s: float,
            prompts: Sequence[Prompt], max_tokens: int, backoff_s: float, seed: int = 0,
            ramp_s: float = 0.0) -> list[Sample]:
        """Every user of ``groups`` in a closed loop for ``duration_s``; the requests still running
        then are read to their end (bounded) and counted."""
        load = Load(base_url, model, tuple(prompts), max_tokens, backoff_s,
                    time.monotonic() + duration_s, seed, ramp_s)
        shares = deal(groups, self.workers)
        if self._pool is None:
            return [s for share in shares for s in run_share(load, share)]
        futures = [self._pool.submit(run_share, load, share) for share in shares]
        return [s for f in futures for s in f.result()]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> LoadGen:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
