"""loadtests.bench_procs: a started process is accounted and stopped with its whole tree."""

from __future__ import annotations

import os
import time
from pathlib import Path

from loadtests import bench_procs as procs


def test_stop_kills_descendants_that_left_the_process_group(tmp_path: Path) -> None:
    # The background child moves to a session (and group) of its own, as Ray's actors leave ours.
    proc = procs.spawn("tree", ["sh", "-c", "setsid sleep 60 & exec sleep 60"], tmp_path / "log")
    deadline = time.monotonic() + 10
    while procs.cpu_seconds(proc.pid).keys() != {"sleep"} and time.monotonic() < deadline:
        time.sleep(0.05)  # until both have exec'd sleep
    family = procs.descendants(proc.pid)
    assert len(family) == 1, family
    [child] = family
    assert os.getpgid(child) != os.getpgid(proc.pid)
    assert procs.cpu_seconds(proc.pid).keys() == {"sleep"}

    procs.stop(proc, timeout_s=5, grace_s=0.5)
    assert not proc.alive()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # killed, then reaped by init
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or ") Z " in stat.read_text(), "the detached child outlived stop()"
