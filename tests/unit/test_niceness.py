"""renice_process_threads sets every thread of a process; haproxy_pids finds this session's HAProxy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.local import front_door
from serve_app.local.ports import free_port
from serve_app.runtime import niceness

# A child with three threads in all, so a per-process renice (one thread) would be caught.
THREADS = "import threading, time\n[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(2)]\nprint('ready', flush=True)\ntime.sleep(60)\n"


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen([sys.executable, "-c", THREADS], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    yield p
    p.kill()
    p.wait()
    p.stdout.close()


def test_every_thread_of_a_process_gets_the_niceness(child: subprocess.Popen[str]) -> None:
    before = niceness.thread_niceness(child.pid)
    assert len(before) == 3
    target = max(before.values()) + 3

    changed = niceness.renice_process_threads(child.pid, target)

    assert sorted(changed) == sorted(before)
    assert set(niceness.thread_niceness(child.pid).values()) == {target}
    assert niceness.renice_process_threads(child.pid, target) == []  # idempotent


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering niceness needs root (CAP_SYS_NICE)")
def test_root_brings_threads_back_to_zero(child: subprocess.Popen[str]) -> None:
    niceness.renice_process_threads(child.pid, 15)  # as Ray starts its workers
    niceness.renice_process_threads(child.pid, 0)
    assert set(niceness.thread_niceness(child.pid).values()) == {0}


def test_a_gone_process_has_no_threads() -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    assert niceness.renice_process_threads(p.pid, 5) == []


HAPROXY_CFG = """global
    nbthread 2
defaults
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s
frontend f
    bind 127.0.0.1:{port}
    http-request return status 200
"""


def test_haproxy_of_this_config_is_found_and_reniced(tmp_path: Path) -> None:
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(HAPROXY_CFG.format(port=free_port()))
    other = tmp_path / "other.cfg"
    other.write_text(HAPROXY_CFG.format(port=free_port()))
    procs = [subprocess.Popen([front_door.haproxy_binary(), "-db", "-f", str(c)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
             for c in (cfg, other)]
    try:
        deadline = time.monotonic() + 5
        while ((niceness.haproxy_pids(cfg) != [procs[0].pid]
                or len(niceness.thread_ids(procs[0].pid)) < 2) and time.monotonic() < deadline):
            time.sleep(0.05)  # until HAProxy runs both of its threads
        assert niceness.haproxy_pids(cfg) == [procs[0].pid]
        current = os.getpriority(os.PRIO_PROCESS, procs[0].pid)
        changed = niceness.renice_haproxy(cfg, current + 1)
        assert list(changed) == [procs[0].pid] and changed[procs[0].pid]
        # Every thread, not only the main one (niceness is per thread on Linux; nbthread 2).
        assert set(niceness.thread_niceness(procs[0].pid).values()) == {current + 1}
        assert set(niceness.thread_niceness(procs[1].pid).values()) == {current}  # left alone
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.wait()
