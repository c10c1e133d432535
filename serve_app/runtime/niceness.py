"""Put latency-critical processes back at normal CPU priority.

Ray starts its worker processes at niceness 15, and that includes HAProxy and the gateway
replicas. On a machine whose cores the vLLM engines keep busy (they busy-wait), a niceness-15 front
door waits for CPU: measured under the README's locust load, HAProxy's own ``/-/healthz`` took p95
153-405 ms and the gateway's ``/health`` up to 772 ms; at niceness 0, 1 and 3 ms
(docs in /work/shared/ENVIRONMENT.md). The model replicas stay where Ray put them: raising them
made premium TTFT worse, since a replica's API work then competes with its own engine.

On Linux niceness belongs to each thread (``renice -p PID`` changes one thread), so every thread in
``/proc/<pid>/task`` is set. Lowering niceness needs root (CAP_SYS_NICE); raising it does not.
Threads started later inherit the niceness of the thread that starts them, and HAProxy is a new
process after each reload (``-sf``), so callers repeat the call periodically; it is idempotent.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PROC = Path("/proc")
HAPROXY_NAME = "haproxy"


def thread_ids(pid: int) -> list[int]:
    """The ids of every thread of ``pid`` (empty when the process is gone)."""
    try:
        return sorted(int(t.name) for t in (PROC / str(pid) / "task").iterdir())
    except FileNotFoundError:
        return []


def thread_niceness(pid: int) -> dict[int, int]:
    """Each live thread's niceness."""
    out: dict[int, int] = {}
    for tid in thread_ids(pid):
        with contextlib.suppress(ProcessLookupError):
            out[tid] = os.getpriority(os.PRIO_PROCESS, tid)
    return out


def renice_process_threads(pid: int, niceness: int) -> list[int]:
    """Set every thread of ``pid`` to ``niceness``; returns the threads changed (already there or
    exited ones are skipped). Raises PermissionError when lowering niceness without root."""
    changed = []
    for tid in thread_ids(pid):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
                changed.append(tid)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return changed


def haproxy_pids(config_path: str | os.PathLike[str]) -> list[int]:
    """The HAProxy processes that run ``config_path`` (Ray Serve's config of this session,
    ``RAY_SERVE_HAPROXY_CONFIG_FILE_LOC``), so another stack's HAProxy on the machine is left alone.
    During a reload the old process lives on until its connections end; both are returned."""
    want = os.fsencode(str(config_path))
    pids = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != HAPROXY_NAME:
                continue
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if want in args:
            pids.append(int(entry.name))
    return sorted(pids)


def renice_haproxy(config_path: str | os.PathLike[str], niceness: int = 0) -> dict[int, list[int]]:
    """Every thread of this session's HAProxy processes to ``niceness``; the threads changed, by pid."""
    return {pid: renice_process_threads(pid, niceness) for pid in haproxy_pids(config_path)}
