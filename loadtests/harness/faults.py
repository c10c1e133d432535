"""Process kills under streaming load, seen from the client: the fault tests' and the soak's tools.

- ``find_replica`` / ``find_engine_core``: the pids of a Ray Serve replica and of its vLLM engine
  core process, among the descendants of a stack (by process title: Ray names replica processes
  ``ray::ServeReplica:<app>:<deployment>``, vLLM names its engine ``VLLM::EngineCore``).
- ``kill_and_replace``: SIGKILL a replica and wait for Ray Serve to replace it.
- ``Prober``: one client sending small requests back to back, recording each answer's status,
  ``Retry-After`` and duration: the time to the first clean 503 after a kill, and to recovery.
- ``StreamLoad``: a few clients streaming with the real openai SDK, each request classified by
  ``classify`` into what a client sees: ``completed``, ``error_event`` (an error event and
  ``[DONE]``), ``unavailable``/``rate_limited`` (503/429 with ``Retry-After``), or a failure:
  ``cut`` (the stream stopped with no error event), ``no_retry_after``, ``bad_status``.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtests.harness.stack import cmdline, descendants, proc_stat
from serve_app.config import APP_NAME

OK_KINDS = frozenset({"completed", "error_event", "unavailable", "rate_limited"})


# ---- processes ----------------------------------------------------------------------------------
def _title(pid: int) -> str:
    return " ".join(a for a in cmdline(pid) if a)


def find_replicas(root: int, deployment: str, app: str = APP_NAME) -> list[int]:
    """Pids of a deployment's replica processes under ``root`` (Ray's process title)."""
    # Exactly this deployment: "model-tiny-chat" must not match "model-tiny-chat-b". Ray appends
    # ".method" to the title while an actor runs a task.
    title = re.compile(rf"^ray::ServeReplica:{re.escape(app)}:{re.escape(deployment)}(?:[.\s]|$)")
    return sorted(pid for pid in descendants(root) if title.match(_title(pid)))


def kill_and_replace(root: int, deployment: str, timeout_s: float = 120.0) -> None:
    """SIGKILL one replica of ``deployment`` and wait until Ray Serve has as many again (a gateway
    replica's restart, seen from outside)."""
    import os
    import signal

    before = find_replicas(root, deployment)
    assert before, f"no replica of {deployment} to kill"
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = find_replicas(root, deployment)
        if len(now) >= len(before) and before[0] not in now:
            return
        time.sleep(1)
    raise AssertionError(f"the killed {deployment} replica was not replaced within {timeout_s} s")


def find_engine_core(replica_pid: int) -> int | None:
    for pid in descendants(replica_pid):
        if _title(pid).startswith("VLLM::EngineCore"):
            return pid
    return None


def find_controller(root: int) -> int | None:
    for pid in descendants(root):
        if _title(pid).startswith("ray::ServeController"):
            return pid
    return None


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def loaded_libraries(pid: int, names: Iterable[str] = ("torch", "vllm")) -> list[str]:
    """Which of ``names`` appear in a process's memory maps (e.g. torch loaded into Ray Serve's
    controller when it unpickles an exception raised by vLLM)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except OSError:
        return []
    return [n for n in names if n in maps]


def alive(pid: int) -> bool:
    return proc_stat(pid) is not None


# ---- outcomes -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    """One request as its client saw it."""

    kind: str
    started: float
    ended: float
    status: int | None = None
    retry_after: str | None = None
    tokens: int = 0
    detail: str = ""

    @property
    def duration(self) -> float:
        return self.ended - self.started


def classify(status: int | None, retry_after: str | None, *, finished: bool = False,
             error_event: bool = False, connection_error: bool = False) -> str:
    """What a client saw, from the facts its SDK gave it (see the module docstring)."""
    if status is not None and status != 200:
        if status in (503, 429):
            if not retry_after:
                return "no_retry_after"
            return "unavailable" if status == 503 else "rate_limited"
        return "bad_status"
    if error_event:
        return "error_event"
    if finished and not connection_error:
        return "completed"
    return "cut"


def stream_once(client: Any, model: str, max_tokens: int, started: float | None = None) -> Result:
    """One streamed chat completion with the openai SDK (``max_retries=0``), classified."""
    import openai

    t0 = time.monotonic() if started is None else started
    finished = False
    tokens = 0
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "tell me a story"}],
            max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                finished = True
    except openai.APIStatusError as exc:
        return Result(classify(exc.status_code, exc.response.headers.get("retry-after")),
                      t0, time.monotonic(), exc.status_code, exc.response.headers.get("retry-after"),
                      detail=str(exc)[:200])
    except openai.APIConnectionError as exc:
        return Result("cut", t0, time.monotonic(), detail=f"APIConnectionError: {exc}"[:200])
    except openai.APIError as exc:  # the SDK raises this for an error event inside a stream
        return Result(classify(200, None, error_event=True), t0, time.monotonic(), 200,
                      detail=str(exc)[:200])
    except httpx.HTTPError as exc:  # a chunked body cut in the middle
        return Result("cut", t0, time.monotonic(), detail=f"{type(exc).__name__}: {exc}"[:200])
    kind = classify(200, None, finished=finished)
    return Result(kind, t0, time.monotonic(), 200, tokens=tokens,
                  detail="" if finished else "ended without finish_reason")


def summary(results: Iterable[Result]) -> dict[str, int]:
    return dict(Counter(r.kind for r in results))


# ---- load ---------------------------------------------------------------------------------------
@dataclass
class StreamLoad:
    """``workers`` threads streaming back to back until ``stop``."""

    base_url: str
    api_key: str
    model: str = "tiny-chat"
    workers: int = 4
    max_tokens: int = 200
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self) -> None:
        import openai

        client = openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0,
                               timeout=60)
        while not self._stop.is_set():
            r = stream_once(client, self.model, self.max_tokens)
            with self._lock:
                self.results.append(r)
            if r.kind not in ("completed", "error_event"):
                time.sleep(0.2)  # as a client honouring Retry-After would, but shorter

    def start(self) -> StreamLoad:
        for _ in range(self.workers):
            t = threading.Thread(target=self._run, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout_s: float = 90.0) -> list[Result]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        with self._lock:
            return list(self.results)


@dataclass
class Prober:
    """Small non-streamed requests back to back: (start, status, Retry-After, duration)."""

    base_url: str
    api_key: str
    model: str = "tiny-chat"
    interval_s: float = 0.2
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}
        headers = {"Authorization": f"Bearer {self.api_key}"}
        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    r = http.post(f"{self.base_url}/chat/completions", json=body, headers=headers)
                    ra = r.headers.get("retry-after")
                    kind = "completed" if r.status_code == 200 else classify(r.status_code, ra)
                    self.results.append(Result(kind, t0, time.monotonic(), r.status_code, ra,
                                               detail=r.text[:200] if r.status_code != 200 else ""))
                except httpx.HTTPError as exc:
                    self.results.append(Result("cut", t0, time.monotonic(),
                                               detail=type(exc).__name__))
                self._stop.wait(self.interval_s)

    def start(self) -> Prober:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Result]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(90)
        return list(self.results)

    def wait_for(self, pred: Callable[[Result], bool], after: float, timeout_s: float) -> Result | None:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            rs = self.results
            for r in rs[seen:]:
                if r.started >= after and pred(r):
                    return r
            seen = len(rs)
            time.sleep(0.05)
        return None


def recovery(results: list[Result], kill_at: float) -> tuple[float | None, float | None]:
    """(seconds from the kill to the first clean 503, to the first 200 after a failure)."""
    after = [r for r in results if r.started >= kill_at]
    first_503 = next((r.ended - kill_at for r in after if r.kind == "unavailable"), None)
    failed = False
    for r in after:
        if r.kind != "completed":
            failed = True
        elif failed:
            return first_503, r.ended - kill_at
    return first_503, None
