"""Processes for the benchmark: direct vLLM, the full stack, and finding the stack's Ray cluster.

Every process is started in a process group of its own, so it can be signalled with its children,
and is accounted with all its descendants. Nothing here stops a process that this module did not
start, or a descendant of one.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]


def say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


# ---- /proc helpers --------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, session id, start time) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[3]), int(fields[19])


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int) -> dict[int, int]:
    """Live descendants of a process: pid -> start time (which tells a reused pid apart)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for pid in _all_pids():
        st = _stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append((pid, st[2]))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _label(pid: int) -> str:
    """A short name: the process title of Ray actors and vLLM processes, else the program."""
    args = [a for a in _cmdline(pid) if a]
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


def _ancestors(pid: int) -> set[int]:
    """Live ancestors of a process, up to (not including) init."""
    found: set[int] = set()
    while (st := _stat(pid)) is not None and st[0] > 1 and st[0] not in found:
        pid = st[0]
        found.add(pid)
    return found


def root_of_port(port: int) -> int | None:
    """The root of a running stack's process tree (to account its CPU): the oldest ancestor of
    the process listening on a port that is in the same session and not an ancestor of ours
    (a test session may have started the stack beside this benchmark)."""
    pid = _listener_pid(port)
    st = _stat(pid) if pid is not None else None
    if pid is None or st is None:
        return None
    ours = _ancestors(os.getpid())
    sid = st[1]
    while (parent := _stat(st[0])) is not None and st[0] > 1 and parent[1] == sid \
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
    for pid in _all_pids():
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
        for arg in _cmdline(pid):
            if arg.startswith("--gcs-address="):
                return arg.split("=", 1)[1]
        st = _stat(pid)
        pid = st[0] if st else None
    return None


# ---- processes ------------------------------------------------------------------------------------
@dataclass
class Proc:
    """A process this benchmark started, in its own process group, with its output in ``log``."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class ProcExited(RuntimeError):
    """A process we started exited while we waited for something."""

    def __init__(self, proc: Proc, what: str) -> None:
        self.proc = proc
        super().__init__(
            f"{proc.name} exited with {proc.popen.returncode} while waiting for {what}; "
            f"log {proc.log}:\n{proc.log_tail()}"
        )


def spawn(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    out = open(log, "wb")
    # A process group of its own (stopped as a whole), but this session: Linux shares CPU time
    # between sessions ("autogroup"), and a server in a session of its own starved the load client
    # beside it (tests/integration/conftest.py has the measurement).
    try:
        popen = subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0
        )
    finally:
        out.close()
    return Proc(name, popen, log)


def _signal_group(proc: Proc, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop(proc: Proc, first: int = signal.SIGINT, timeout_s: float = 90.0, grace_s: float = 10.0) -> None:
    """Stop a process we started: ``first`` to its process group, SIGKILL after the timeout, then
    SIGKILL to whatever is left of its process tree (e.g. Ray actors, which have groups of their
    own and outlive their parent for a moment)."""
    family = descendants(proc.pid)  # taken while the tree is whole: orphans lose their parent
    if proc.alive():
        say(f"stopping {proc.name} (pid {proc.pid}, {signal.Signals(first).name}) ...")
        _signal_group(proc, first)
        try:
            proc.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            say(f"{proc.name} still running after {timeout_s:.0f} s: SIGKILL")
            _signal_group(proc, signal.SIGKILL)
            proc.popen.wait()

    def leftovers() -> list[int]:
        return [p for p, start in family.items() if (st := _stat(p)) is not None and st[2] == start]

    # Children get a moment to follow their parent out; then the leftovers are killed by id.
    deadline = time.monotonic() + grace_s
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        say(f"{proc.name}: killed {len(left)} leftover process(es) of its tree: {left}")


def http_status(url: str, timeout_s: float = 5.0, headers: dict[str, str] | None = None,
                body: dict[str, Any] | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={**(headers or {}),
                                 **({"Content-Type": "application/json"} if data else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def wait_until(ready: Callable[[], bool], procs: list[Proc], what: str, timeout_s: float) -> float:
    """Wait for ``ready``; fail fast if one of ``procs`` exits. Prints a progress line every 15 s."""
    t0 = time.monotonic()
    last = t0
    while not ready():
        for p in procs:
            if not p.alive():
                raise ProcExited(p, what)
        now = time.monotonic()
        if now - t0 > timeout_s:
            raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s")
        if now - last >= 15:
            say(f"  ... waiting for {what} ({now - t0:.0f} s)")
            last = now
        time.sleep(1.0)
    return time.monotonic() - t0


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


# ---- the full stack -------------------------------------------------------------------------------
BENCH_TIER = "bench-unlimited"


def write_stack_config(src: Path, dst: Path, port: int, keys_file: Path) -> None:
    """A copy of the config on our own port and keys file, plus one tier without limits.

    The benchmark measures the streaming path, so its key must not be rate-limited or shed: a
    configured tier's RPM or concurrency cap would turn a throughput run into a 429 count. The
    tier has the top priority (0, the priority that direct vLLM gives every request, unless a tier
    is above it), so it may use every engine slot, the top tier's reserve included.
    """
    import yaml

    from serve_app.config import AppConfig

    doc = yaml.safe_load(src.read_text())
    doc["http_options"] = {**(doc.get("http_options") or {}), "host": "127.0.0.1", "port": port}
    args = doc["applications"][0]["args"]
    args.setdefault("gateway", {})["keys_file"] = str(keys_file)
    top = min(0, AppConfig.model_validate(args).top_priority)
    tiers = args.get("tiers") or {"standard": {}}
    tiers[BENCH_TIER] = {"priority": top, "description": "benchmark key: no limits"}
    args["tiers"] = tiers
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))


def start_stack(config: Path, port: int, keys_file: Path, ready_file: Path, log: Path) -> Proc:
    argv = [sys.executable, "-m", "serve_app.cli", "run", "--config", str(config),
            "--host", "127.0.0.1", "--port", str(port), "--ready-file", str(ready_file),
            "--keys-file", str(keys_file)]
    say(f"starting the stack on 127.0.0.1:{port} (log {log})")
    return spawn("stack (serve-app run)", argv, log)
