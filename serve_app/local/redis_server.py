"""A loopback redis-server for the embedded default, so that usage and limits outlive a gateway.

The gateway keeps per-key usage totals and rate-limit counters in Redis when
``gateway.state.redis_url`` is set, and in its own memory otherwise: a gateway replica that died (or a
second replica) started again from zero. ``serve-app run`` with a config that names no Redis
starts one here: Debian's ``redis-server`` (installed by ``scripts/system-deps.sh``), bound to
127.0.0.1 on a free port, persisting to ``<state_dir>`` (append-only file, fsync every second) so
the counters also survive a restart of ``serve-app run``. Without the binary, the gateway keeps
its in-memory counters, as before, and says so.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from serve_app.local.ports import free_port


def redis_argv(exe: str, port: int, state_dir: Path) -> list[str]:
    """Loopback only, no password needed (nothing else can reach it), persisted under state_dir."""
    return [
        exe, "--bind", "127.0.0.1", "--port", str(port), "--protected-mode", "yes",
        "--dir", str(state_dir), "--appendonly", "yes", "--appendfsync", "everysec",
        "--save", "", "--daemonize", "no", "--logfile", str(state_dir / "redis.log"),
    ]


@dataclass
class LocalRedis:
    """A redis-server child process; ``stop`` ends it (it writes its append-only file first)."""

    proc: subprocess.Popen[bytes]
    port: int
    state_dir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class LocalStateError(RuntimeError):
    """redis-server is missing or did not start."""


def start_local_redis(state_dir: Path, timeout_s: float = 10.0,
                      exe: str | None = None) -> LocalRedis:
    exe = exe or shutil.which("redis-server")
    if exe is None:
        raise LocalStateError("redis-server is not installed (sudo bash scripts/system-deps.sh)")
    state_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # Its own session: a Ctrl-C in the terminal must not stop it before the gateways drain.
    proc = subprocess.Popen(redis_argv(exe, port, state_dir), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            # Ready means PONG: while it replays its append-only file, redis accepts connections
            # but answers -LOADING to every command.
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return LocalRedis(proc, port, state_dir)
            raise OSError("redis-server is loading")
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise LocalStateError(
                    f"redis-server did not start (see {state_dir / 'redis.log'})"
                ) from None
            time.sleep(0.05)
