"""Run a command in a network namespace that can reach one TCP port on the host and nothing else.

The agent CLIs (Codex, Claude Code, Cline) try to reach their vendors: telemetry, update checks,
model lists. The real-client tests must not let any of that leave the machine, so each CLI runs
inside ``unshare --net`` (a fresh network namespace, which needs root), where only a loopback
interface exists. A two-part bridge makes the stack's port reachable there, and nothing else:

    CLI -> 127.0.0.1:PORT (in the namespace)       inside half: ``python -m tests.integration.agents
        -> Unix socket (the file system is shared)   inside SOCK PORT -- CMD...`` listens on the port,
        -> 127.0.0.1:PORT (on the host)               forwards each connection to the socket, runs CMD
                                                      and exits with its code
                                                    outside half: ``Bridge`` (a thread in the test
                                                      process) accepts on the socket and connects to
                                                      the stack

The same port number on both sides keeps the README's URLs valid inside the namespace. DNS fails
there (no resolver is reachable), so a vendor host name never resolves. Each half is a few lines
of asyncio (there is no socat). The bridge is the command's parent, not a background job, so it
holds no pipe of its own open; when the command exits, the inside half kills whatever else is left
in the namespace (Cline's hub daemon outlives its command), so no pipe stays open after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENTS_BIN = ROOT / ".clients" / "bin"


def can_unshare() -> bool:
    """Whether this process may create a network namespace (root, or a user namespace allowed)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


_REQUEST_LINE = re.compile(rb"^(GET|HEAD|POST|PUT|PATCH|DELETE|OPTIONS) (\S+) HTTP/1\.[01]\r$", re.M)
_STATUS_LINE = re.compile(rb"^HTTP/1\.[01] (\d{3})", re.M)


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[str] | None = None,
    pattern: re.Pattern[bytes] | None = None,
) -> None:
    try:
        while data := await reader.read(65536):
            if seen is not None and pattern is not None:
                # What crossed, for the test's log: request lines one way, status codes the other
                # (a scan of the raw bytes; a body that contained such a line would add one).
                seen.extend(b" ".join(m.groups()).decode() for m in pattern.finditer(data))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - the peer may already be gone
            pass


async def _splice(
    client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
    up_r: asyncio.StreamReader, up_w: asyncio.StreamWriter,
    requests: list[str] | None = None, statuses: list[str] | None = None,
) -> None:
    await asyncio.gather(_pipe(client_r, up_w, requests, _REQUEST_LINE),
                         _pipe(up_r, client_w, statuses, _STATUS_LINE))


class Bridge:
    """The outside half: a Unix socket whose connections are forwarded to 127.0.0.1:``port``.

    Runs its own event loop in a daemon thread; ``connections`` counts what came through, and
    ``requests`` / ``statuses`` list the HTTP request lines and response codes that crossed it, so
    a test can show what a client sent and what it got.
    """

    def __init__(self, socket_path: Path, port: int) -> None:
        self.socket_path = socket_path
        self.port = port
        self.connections = 0
        self.requests: list[str] = []
        self.statuses: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _on_client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(w)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            w.close()
            return
        self._writers.append(up_w)
        with contextlib.suppress(asyncio.CancelledError):  # the bridge is closing
            await _splice(r, w, up_r, up_w, self.requests, self.statuses)

    def __enter__(self) -> Bridge:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_unix_server(self._on_client, path=str(self.socket_path)), self._loop
        ).result(timeout=10)
        return self

    def __exit__(self, *_: object) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            # Let each connection's task run its finally (it closes its sockets).
            await asyncio.gather(*tasks, return_exceptions=True)
            # A closed writer whose peer stopped reading keeps its socket open until its buffer
            # drains, which would be never: abort them all, so no socket outlives the bridge.
            for writer in self._writers:
                writer.transport.abort()
            await asyncio.sleep(0)
            if self._server is not None:
                await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self.socket_path.unlink(missing_ok=True)


def netns_command(socket_path: Path, port: int, argv: Sequence[str]) -> list[str]:
    """The argv that runs ``argv`` in a fresh network namespace with the port bridged in."""
    return ["unshare", "--net", sys.executable, "-m", "tests.integration.agents", "inside",
            str(socket_path), str(port), "--", *argv]


def run_isolated(
    argv: Sequence[str], *, port: int, workdir: Path, env: dict[str, str], timeout: float,
    stdin: str | None = None,
) -> tuple[subprocess.CompletedProcess[str], Bridge]:
    """Run ``argv`` in its own network namespace that reaches only 127.0.0.1:``port``.

    Returns the finished process and the bridge (its connections, request lines and statuses).
    """
    socket_path = workdir / "bridge.sock"
    socket_path.unlink(missing_ok=True)
    full_env = {"PYTHONPATH": str(ROOT), **env}
    with Bridge(socket_path, port) as bridge:
        proc = subprocess.run(
            netns_command(socket_path, port, argv), cwd=workdir, env=full_env, input=stdin,
            capture_output=True, text=True, timeout=timeout,
        )
    return proc, bridge


# ---- the inside half (runs in the namespace) --------------------------------------------------
async def _inside(socket_path: str, port: int, argv: list[str]) -> int:
    async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_unix_connection(socket_path)
        except OSError:
            w.close()
            return
        await _splice(r, w, up_r, up_w)

    server = await asyncio.start_server(on_client, "127.0.0.1", port)
    proc = await asyncio.create_subprocess_exec(*argv)
    code = await proc.wait()
    server.close()
    return code


def _namespace_leftovers() -> list[int]:
    """Pids of the other processes in this network namespace (daemons a CLI left behind)."""
    mine = os.readlink("/proc/self/ns/net")
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/net") == mine:
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def inside_main(args: list[str]) -> int:
    socket_path, port, sep, *argv = args
    if sep != "--" or not argv:
        raise SystemExit("usage: python -m tests.integration.agents inside SOCK PORT -- CMD ...")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)  # a fresh namespace has it down
    code = asyncio.run(_inside(socket_path, int(port), argv))
    # Everything still in this namespace was started by CMD (Cline's hub daemon outlives its
    # command): stop it by pid, or it would hold the caller's stdout pipe open forever.
    for pid in _namespace_leftovers():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return code


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "inside":
        sys.exit(inside_main(sys.argv[2:]))
    raise SystemExit(__doc__)
