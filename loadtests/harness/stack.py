"""The one stack harness: start the app as a user does, wait until it is ready, stop all of it.

The integration tests' session stack, the sweep, the benchmark and the locust UI test all start
processes through this module, and only this module starts ``serve-app run``. It treats the app
as a black box: it calls the public commands (``serve-app run``, ``serve-app keys create``),
reads config files only through ``serve_app.config`` and takes free ports from
``serve_app.local.ports`` (the one port finder, which imports nothing of the app).

    stack = start_stack(Path("configs/local.yaml"), workdir, keys={"me": ("premium", ["*"])})
    try:
        httpx.get(f"{stack.base_url}/models", headers={"Authorization": f"Bearer {stack.keys['me']}"})
    finally:
        stack.stop()  # the whole process tree

Every process is started in a process group of its own, so that it can be signalled with its
children, and stopped with its whole tree, Ray's processes included. Nothing here stops a
process that this module did not start, or a descendant of one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from serve_app.config import AppConfig, format_validation_error, load_app_config
from serve_app.local.ports import free_port as free_port  # re-exported for the benchmarks

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "serve_app.cli"]
HOST = "127.0.0.1"
START_TIMEOUT_S = 900.0

Say = Callable[[str], None]
EditArgs = Callable[[dict[str, Any]], None]


def _say(msg: str) -> None:
    print(f"[stack] {msg}", flush=True)


# ---- /proc ------------------------------------------------------------------------------------------
def proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, session id, start time) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[3]), int(fields[19])


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def descendants(root: int) -> dict[int, int]:
    """Live descendants of a process: pid -> start time (which tells a reused pid apart)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for pid in all_pids():
        st = proc_stat(pid)
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


# ---- processes --------------------------------------------------------------------------------------
@dataclass
class Proc:
    """A process started here, in a process group of its own, with its output in ``log``."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    # Descendants seen so far (pid -> start time): a process whose parent died is no longer
    # found by a walk from the root, but must still be stopped with it.
    family: dict[int, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def remember_family(self) -> dict[int, int]:
        self.family.update(descendants(self.pid))
        return self.family

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class StackError(RuntimeError):
    """A stack (or a process beside it) did not start."""


class ConfigRefused(StackError):
    """The copy of a config (with a caller's edits) is not a valid app config."""


class ProcExited(StackError):
    """A process started here exited while we waited for something."""

    def __init__(self, proc: Proc, what: str) -> None:
        self.proc = proc
        super().__init__(
            f"{proc.name} exited with {proc.popen.returncode} while waiting for {what}; "
            f"log {proc.log}:\n{proc.log_tail()}"
        )


def spawn(name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> Proc:
    """Start ``argv`` with its output in ``log``, in a process group of its own (so that it can be
    stopped as a whole) but in the caller's session.

    Not a session of its own: Linux groups CPU time by session ("autogroup"). In a session of its
    own, the stack, whose engines spin on both cores, left the caller (the load client) waiting on
    the run queue for 9 s of 10 (/proc/PID/schedstat), so tests measured the client's starvation.
    In one session, Ray's nice 15 for its workers lets the client run first, as a client on
    another host would.
    """
    out = open(log, "wb")
    try:
        popen = subprocess.Popen(
            list(argv), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None, process_group=0,
        )
    finally:
        out.close()
    return Proc(name, popen, log)


def _signal_group(proc: Proc, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop(proc: Proc, first: int = signal.SIGINT, timeout_s: float = 90.0, grace_s: float = 10.0,
         say: Say = _say) -> None:
    """Stop a process started here: ``first`` to its process group, SIGKILL to the group after
    ``timeout_s``, then SIGKILL to whatever is left of its process tree (Ray's raylet, workers and
    engine processes have groups or sessions of their own and can outlive their parent)."""
    family = proc.remember_family()  # taken while the tree is whole: orphans lose their parent
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
        return [p for p, start in family.items()
                if (st := proc_stat(p)) is not None and st[2] == start]

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


def wait_until(ready: Callable[[], bool], procs: Iterable[Proc], what: str, timeout_s: float,
               say: Say = _say) -> float:
    """Wait for ``ready``; fail fast (``ProcExited``, with the log tail) if one of ``procs``
    exits. Prints a progress line every 15 s; returns the seconds waited."""
    watched = list(procs)
    t0 = time.monotonic()
    last = t0
    while not ready():
        for p in watched:
            if not p.alive():
                raise ProcExited(p, what)
            p.remember_family()
        now = time.monotonic()
        if now - t0 > timeout_s:
            raise StackError(f"{what} not ready after {timeout_s:.0f} s")
        if now - last >= 15:
            say(f"  ... waiting for {what} ({now - t0:.0f} s)")
            last = now
        time.sleep(0.5)
    return time.monotonic() - t0


def http_status(url: str, timeout_s: float = 5.0, headers: Mapping[str, str] | None = None,
                body: Mapping[str, Any] | None = None) -> int:
    """The HTTP status of one request, 0 if there is no answer."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={
        **(headers or {}), **({"Content-Type": "application/json"} if data else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


# ---- config and keys --------------------------------------------------------------------------------
def driver_env(ray_address: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a driver that an operator runs against a cluster (``serve-app
    diagnose``): ``base`` (this process's) without Ray Serve's settings (their throughput mode
    needs an event loop in a handle's caller), connected to ``ray_address`` with token auth."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("RAY_SERVE_")}
    env.update(RAY_ADDRESS=ray_address, RAY_AUTH_MODE="token")
    return env


def read_config(path: Path) -> AppConfig:
    """The validated app config of a Ray Serve config file (its first application)."""
    return load_app_config(path)


def copy_config(src: Path, dst: Path, *, port: int, keys_file: Path,
                edit: EditArgs | None = None) -> Path:
    """A copy of the Ray Serve config ``src`` on ``HOST:port`` with its own keys file; ``edit``
    may change the app's ``args`` in place. The copy is validated, so a bad edit fails here
    (``ConfigRefused``, naming the field and value), not as an app that exits at once."""
    doc = yaml.safe_load(src.read_text())
    if not isinstance(doc, dict) or not doc.get("applications"):
        raise StackError(f"{src}: not a Ray Serve config file (no 'applications')")
    doc["http_options"] = {**(doc.get("http_options") or {}), "host": HOST, "port": port}
    app = doc["applications"][0]
    args: dict[str, Any] = app.get("args") or {}
    app["args"] = args
    gateway = args["gateway"] = dict(args.get("gateway") or {})
    gateway["keys"] = {**(gateway.get("keys") or {}), "file": str(keys_file)}
    if edit is not None:
        edit(args)
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        read_config(dst)
    except ValidationError as exc:
        raise ConfigRefused(format_validation_error(exc, "args")) from None
    return dst


def keys_create(keys_file: Path, key_id: str, tier: str, models: Sequence[str] = ("*",)) -> str:
    """A new key in ``keys_file``, made by the public ``serve-app keys create`` command (which runs
    the one ``KeyOps``, serve_app/gateway/keys/ops.py; tests may call it through tests/keys.py);
    returns its secret (the command's last line)."""
    argv = [*CLI, "keys", "create", "--keys-file", str(keys_file), "--id", key_id, "--tier", tier,
            "--models", ",".join(models)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise StackError(f"serve-app keys create --id {key_id} failed ({done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()[-2000:]}")
    return lines[-1].strip()


# ---- the stack --------------------------------------------------------------------------------------
@dataclass
class Stack:
    """A running ``serve-app run``: its URLs, the keys made for it (id -> secret), its files."""

    workdir: Path
    config: Path
    proc: Proc
    keys: dict[str, str] = field(default_factory=dict)
    base_url: str = ""  # ends with /v1; set once the app is ready

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    @property
    def log(self) -> Path:
        return self.proc.log

    @property
    def keys_file(self) -> Path:
        return self.workdir / "keys.yaml"

    @property
    def ready_file(self) -> Path:
        return self.workdir / "ready.json"

    def ray_address(self) -> str | None:
        """The GCS address of the Ray cluster this stack started (named on its raylet's command
        line), so that a driver connects to this cluster even when others run on the machine."""
        for pid in descendants(self.proc.pid):
            for arg in cmdline(pid):
                if arg.startswith("--gcs-address="):
                    return arg.split("=", 1)[1]
        return None

    def wait_keys(self, accepted: Sequence[str] = (), rejected: Sequence[str] = (),
                  timeout_s: float = 10.0) -> float:
        """Poll until every gateway replica accepts ``accepted`` and refuses ``rejected`` secrets
        (after a keys file edit). A replica re-reads the file on a request, at most once per
        ``gateway.keys.reload_interval_s``; consecutive requests are spread over the replicas, so
        twice as many agreeing answers in a row as there are replicas mean each one has seen the
        edit. ``GET /v1/models`` checks the key without counting against its limits."""
        replicas = read_config(self.config).gateway.num_replicas
        want = [(s, 200) for s in accepted] + [(s, 401) for s in rejected]
        t0 = time.monotonic()
        streak = 0
        while streak < 2 * replicas:
            agree = all(http_status(f"{self.base_url}/models", 10,
                                    {"Authorization": f"Bearer {s}"}) == code for s, code in want)
            streak = streak + 1 if agree else 0
            if not agree:
                if time.monotonic() - t0 > timeout_s:
                    raise StackError(f"the gateway did not pick up the keys file edit in {timeout_s} s")
                time.sleep(0.1)
        return time.monotonic() - t0

    def stop(self, say: Say = _say) -> None:
        stop(self.proc, say=say)


def _launch(config: Path, workdir: Path, log: Path, timeout_s: float,
            run_args: Sequence[str] = ()) -> Proc:
    ready = workdir / "ready.json"
    ready.unlink(missing_ok=True)
    argv = [*CLI, "run", "--config", str(config), "--ready-file", str(ready),
            "--timeout", str(int(timeout_s)), *run_args]
    return spawn("stack (serve-app run)", argv, log)


def start_stack(src: Path, workdir: Path, *,
                keys: Mapping[str, tuple[str, Sequence[str]]] | None = None,
                edit: EditArgs | None = None, port: int | None = None,
                timeout_s: float = START_TIMEOUT_S, retries: int = 0, watch: Iterable[Proc] = (),
                run_args: Sequence[str] = (), say: Say = _say) -> Stack:
    """Copy ``src`` into ``workdir`` (free loopback port, private keys file, ``edit`` applied),
    create ``keys`` (id -> (tier, models)), start ``serve-app run`` (with ``run_args``, public
    options such as ``--prometheus``) and wait until it is ready.

    Fails fast with the log's tail if the app (or a process in ``watch``) exits first; an app
    that exits during start-up is started again up to ``retries`` times (Ray's own node start-up
    can time out on a busy machine). Stop it with ``Stack.stop``."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port(HOST)
    keys_file = workdir / "keys.yaml"
    config = copy_config(src, workdir / "serve.yaml", port=port, keys_file=keys_file, edit=edit)
    made = {kid: keys_create(keys_file, kid, tier, models)
            for kid, (tier, models) in (keys or {}).items()}
    watched = list(watch)
    attempt = 1
    while True:
        log = workdir / ("stack.log" if attempt == 1 else f"stack-{attempt}.log")
        say(f"starting the app on {HOST}:{port} (log {log})")
        stack = Stack(workdir=workdir, config=config,
                      proc=_launch(config, workdir, log, timeout_s, run_args), keys=made)
        try:
            t = wait_until(stack.ready_file.exists, [stack.proc, *watched], "the app", timeout_s, say)
        except ProcExited as exc:
            stack.stop(say)
            if exc.proc is not stack.proc or attempt > retries:
                raise
            say(f"the app exited during start-up (attempt {attempt}); starting it once more")
            attempt += 1
            continue
        except StackError as exc:  # not ready in time
            stack.stop(say)
            raise StackError(f"{exc}; log {log}:\n{stack.proc.log_tail()}") from None
        except BaseException:
            stack.stop(say)
            raise
        stack.base_url = json.loads(stack.ready_file.read_text())["base_url"]
        say(f"ready in {t:.0f} s at {stack.base_url}")
        return stack
