"""Processes for the benchmark: direct vLLM, CPU accounting of a process tree, finding a running
stack's Ray cluster, and keeping one side's vLLM engines live at a time (``EngineSwitch``: the other
sides' engines are suspended with SIGSTOP and resumed with SIGCONT). Starting and stopping processes
(and the stack) is loadtests.harness.stack's job; nothing here ends a process. Also where every
benchmark run writes its results (``new_run``, ``write_results``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from loadtests.bench.report import is_engine
from loadtests.harness.stack import Proc, all_pids, cmdline, descendants, proc_stat, spawn

ROOT = Path(__file__).resolve().parents[2]


def say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


@dataclass(frozen=True)
class Run:
    """One benchmark run: its config file, where its results go (``base`` plus .json/.md), its
    timestamp and the command that made it (printed in the report)."""

    config: Path
    base: Path
    stamp: str
    command: str


def new_run(kind: str, module: str, config: str, results_dir: str, argv: list[str] | None) -> Run:
    """The run of ``python -m module`` with ``argv``: a relative config is the repo's."""
    path = Path(config) if Path(config).is_absolute() else ROOT / config
    out_dir = Path(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    command = " ".join(["python", "-m", module, *(argv if argv is not None else sys.argv[1:])])
    return Run(path, out_dir / f"{kind}-{stamp}", stamp, command)


def write_results(base: Path, doc: dict[str, Any], md: str) -> None:
    """The run's JSON and markdown beside each other, and the markdown on the console."""
    base.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    base.with_suffix(".md").write_text(md)
    print("\n" + md, flush=True)
    say(f"wrote {base.with_suffix('.json')} and {base.with_suffix('.md')}")


def require_loopback(url: str) -> None:
    """Benchmark traffic may only go to loopback; refuse anything else before sending a byte."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"refusing to send benchmark traffic to {url!r}: only loopback addresses are allowed")


# ---- process trees -------------------------------------------------------------------------------
def _label(pid: int) -> str:
    """A short name: the process title of Ray actors and vLLM processes, else the program."""
    args = [a for a in cmdline(pid) if a]
    if not args:
        return "?"
    if "::" in args[0]:  # ray::ServeReplica:llm:gateway.<method>, VLLM::EngineCore
        return args[0].split(" ")[0].split(".")[0]
    if "-m" in args[:-1]:
        return "python -m " + args[args.index("-m") + 1]
    prog = Path(args[0]).name
    if prog.startswith("python") and len(args) > 1:
        return "python " + args[1] if args[1].startswith("-") else Path(args[1]).name
    return prog


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each kind of process in a process tree."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in (root, *descendants(root)):
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        label = _label(pid)
        out[label] = out.get(label, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_seconds_of(roots: list[int]) -> dict[str, float]:
    """``cpu_seconds`` of several process trees together (a proxy and the server behind it)."""
    out: dict[str, float] = {}
    for root in roots:
        for k, v in cpu_seconds(root).items():
            out[k] = out.get(k, 0.0) + v
    return out


# ---- one live engine at a time ---------------------------------------------------------------------
# Seconds between resuming a side's engines and its run: the resumed processes get scheduled again
# and a suspended engine that was still busy-waiting (vLLM's CPU engine spins about a second after
# its last request) has spun out.
ENGINE_SETTLE_S = 1.0


def process_table() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (parent pid, ``_label``)."""
    table: dict[int, tuple[int, str]] = {}
    for pid in all_pids():
        st = proc_stat(pid)
        if st is not None:
            table[pid] = (st[0], _label(pid))
    return table


def engine_pids(roots: Iterable[int], table: Mapping[int, tuple[int, str]]) -> set[int]:
    """The vLLM engine processes in the trees under ``roots``: every process labelled as an engine
    (``VLLM::EngineCore``, its ``VLLM::Worker``) and everything below one. Front ends (vLLM's API
    server, Ray Serve replicas, Ray's daemons, HAProxy) are never in it."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [(root, False) for root in roots]
    seen: set[int] = set()
    while todo:
        pid, below_engine = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        engine = below_engine or (pid in table and is_engine(table[pid][1]))
        if engine:
            found.add(pid)
        todo += [(child, engine) for child in children.get(pid, [])]
    return found


def suspension_plan(engines: Mapping[str, set[int]], side: str) -> tuple[set[int], set[int]]:
    """(suspend, resume) before ``side``'s run: every other side's engines are suspended, the
    side's own resumed. A side that fronts another's engine (the LiteLLM proxy, whose process tree
    list includes direct vLLM's) has that engine among its own, so it stays live."""
    live = set(engines.get(side, set()))
    every: set[int] = set().union(*engines.values()) if engines else set()
    return every - live, live


def _state(pid: int) -> str | None:
    """The scheduler state letter of a process (``T`` when stopped), or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()[0]


@dataclass
class EngineSwitch:
    """Keeps only the side under test's vLLM engines running.

    A vLLM CPU engine pins its OpenMP thread to the same core as every other engine here and
    busy-waits about a second after its last request, so a side's idle engine slows whichever side
    runs next. ``only(side)`` suspends (SIGSTOP) the engine processes of every other side and
    resumes (SIGCONT) the side's own, then waits ``settle_s``. Only engine processes are suspended:
    the front ends (vLLM's API server, Ray Serve's replicas, which answer health checks from their
    own process, Ray's daemons) keep running, so nothing declares a suspended engine dead.
    ``resume_all`` must run before any process is stopped: a stopped process never handles the
    signal that asks it to exit.

    ``roots`` is each side's list of process-tree roots (the ones its CPU is accounted from).
    Engines are looked up again before every run, so a replaced replica's new engine is found.
    """

    roots: Mapping[str, list[int]]
    settle_s: float = ENGINE_SETTLE_S
    kill: Callable[[int, int], None] = os.kill
    sleep: Callable[[float], None] = time.sleep
    table: Callable[[], Mapping[int, tuple[int, str]]] = process_table
    state: Callable[[int], str | None] = _state
    suspended: set[int] = field(default_factory=set)

    def engines(self) -> dict[str, set[int]]:
        table = self.table()
        return {side: engine_pids(roots, table) for side, roots in self.roots.items()}

    def only(self, side: str) -> dict[str, Any]:
        """Suspend every other side's engines, resume ``side``'s, wait ``settle_s``. Returns what
        was done, for the run's record: the engine processes left live and those suspended (by
        side), and whether every suspended one was seen stopped."""
        engines = self.engines()
        stop, live = suspension_plan(engines, side)
        for pid in sorted(stop):
            self._signal(pid, signal.SIGSTOP)
            self.suspended.add(pid)
        for pid in sorted(live):
            self._signal(pid, signal.SIGCONT)
            self.suspended.discard(pid)
        self.sleep(self.settle_s)
        return {
            "live": len(live),
            "suspended": {s: len(p - live) for s, p in engines.items() if p - live},
            "suspended_verified": self._all_stopped(stop),
            "settle_s": self.settle_s,
        }

    def _all_stopped(self, pids: set[int], tries: int = 20) -> bool:
        """Whether every suspended process is seen stopped (SIGSTOP takes effect when the process
        is next scheduled, so it is polled for up to ``tries`` x 0.1 s)."""
        for _ in range(tries):
            if all(self.state(pid) in ("T", "t", None) for pid in pids):
                return True
            self.sleep(0.1)
        return False

    def resume_all(self) -> None:
        """SIGCONT every engine process suspended so far (and any found now): before shutdown."""
        pids = set(self.suspended)
        try:
            pids |= set().union(*self.engines().values())
        except Exception:  # resuming what we know of matters more than a fresh scan
            pass
        for pid in sorted(pids):
            self._signal(pid, signal.SIGCONT)
        self.suspended.clear()

    def _signal(self, pid: int, sig: int) -> None:
        try:
            self.kill(pid, sig)
        except ProcessLookupError:
            self.suspended.discard(pid)


def _ancestors(pid: int) -> set[int]:
    """Live ancestors of a process, up to (not including) init."""
    found: set[int] = set()
    while (st := proc_stat(pid)) is not None and st[0] > 1 and st[0] not in found:
        pid = st[0]
        found.add(pid)
    return found


def root_of_port(port: int) -> int | None:
    """The root of a running stack's process tree (to account its CPU): the oldest ancestor of
    the process listening on a port that is in the same session and not an ancestor of ours
    (a test session may have started the stack beside this benchmark)."""
    pid = _listener_pid(port)
    st = proc_stat(pid) if pid is not None else None
    if pid is None or st is None:
        return None
    ours = _ancestors(os.getpid())
    sid = st[1]
    while (parent := proc_stat(st[0])) is not None and st[0] > 1 and parent[1] == sid \
            and st[0] not in ours:
        pid, st = st[0], parent
    return pid


def _listener_pid(port: int) -> int | None:
    """The process listening on a TCP port (IPv4 or IPv6), found through its socket inode."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return None
    for pid in all_pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
            except OSError:
                continue
    return None


def ray_address_for_http_port(port: int, root: int | None = None) -> str | None:
    """The GCS address of the Ray cluster whose Serve proxy listens on ``port``.

    ``ray.init(address="auto")`` picks any cluster when several run on one machine (the test
    suite may run its own). Instead: the process listening on the port is the Serve proxy actor;
    its parent is that cluster's raylet, whose command line names the GCS (``--gcs-address=``).
    With ``root``, the proxy must descend from it (the stack we started).
    """
    pid: int | None = _listener_pid(port)
    if pid is not None and root is not None and pid != root and root not in _ancestors(pid):
        return None
    for _ in range(8):
        if pid is None or pid <= 1:
            return None
        for arg in cmdline(pid):
            if arg.startswith("--gcs-address="):
                return arg.split("=", 1)[1]
        st = proc_stat(pid)
        pid = st[0] if st else None
    return None


# ---- the direct vLLM server -----------------------------------------------------------------------
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def to_cli_flags(kwargs: dict[str, Any], known: set[str]) -> list[str]:
    """AsyncEngineArgs / FrontendArgs keyword arguments as vLLM CLI flags."""
    flags: list[str] = []
    for k, v in kwargs.items():
        f = _flag(k)
        if isinstance(v, bool):
            if v:
                flags.append(f)
            elif "--no-" + f[2:] in known:
                flags.append("--no-" + f[2:])
            # else: a store_true flag whose default is False; verified below.
        elif isinstance(v, (list, tuple)):
            flags += [f, *map(str, v)]
        elif isinstance(v, dict):
            flags += [f, json.dumps(v)]
        else:
            flags += [f, str(v)]
    return flags


def direct_server_flags(engine_kw: dict[str, Any], frontend: dict[str, Any]) -> list[str]:
    """The api_server flags for the app's engine arguments, checked by parsing them back with
    vLLM's own parser: every engine argument must come out exactly as the app would pass it."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    known = {s for a in parser._actions for s in a.option_strings}
    flags = to_cli_flags(engine_kw, known) + to_cli_flags(frontend, known)
    ns = parser.parse_args(flags)
    parsed = AsyncEngineArgs.from_cli_args(ns)
    wrong = {k: (v, getattr(parsed, k, None)) for k, v in engine_kw.items()
             if getattr(parsed, k, None) != (list(v) if isinstance(v, tuple) else v)}
    wrong.update({k: (v, getattr(ns, k, None)) for k, v in frontend.items() if getattr(ns, k, None) != v})
    if wrong:
        raise SystemExit(f"engine arguments do not survive the CLI translation: {wrong}")
    return flags


# Ray starts its workers (the gateway and model replicas, and so the engine's processes) at this
# niceness; direct vLLM runs at it too, so that on both sides the load client, this process at
# niceness 0, is served first, as a client on another host would be.
RAY_WORKER_NICENESS = 15


def start_direct(flags: list[str], port: int, env: dict[str, str], log: Path) -> Proc:
    argv = ["nice", "-n", str(RAY_WORKER_NICENESS),
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags,
            "--host", "127.0.0.1", "--port", str(port)]
    say(f"starting direct vLLM on 127.0.0.1:{port}: {' '.join(argv[1:])}")
    if env:
        say(f"  env: {' '.join(f'{k}={v}' for k, v in env.items())}")
    return spawn("direct vLLM", argv, log, env={**os.environ, **env})
