"""A tiny raw-HTTP/1.1 client for hostile-input tests: sends bytes exactly as given (no client
library would send a NUL in a header or a bad Content-Length) and reads one answer."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RawResponse:
    """One answer (or none: ``status`` 0 when the server closed or timed out without one)."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    elapsed_s: float = 0.0
    raw: bytes = b""
    timed_out: bool = False

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    """The body of a chunked message, and whether its last chunk arrived."""
    out = bytearray()
    pos = 0
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return bytes(out), False
        try:
            size = int(data[pos:eol].split(b";")[0], 16)
        except ValueError:
            return bytes(out), False
        if size == 0:
            return bytes(out), True
        start = eol + 2
        if len(data) < start + size + 2:
            return bytes(out), False
        out += data[start:start + size]
        pos = start + size + 2


def _parse(buf: bytes) -> tuple[RawResponse | None, bool]:
    """(response so far, complete?) from the bytes received."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None, False
    lines = buf[:end].decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split(" ", 2)[1])
    except (IndexError, ValueError):
        return None, False
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    rest = buf[end + 4:]
    if 100 <= status < 200:  # an interim answer: read the final one after it
        return None, False
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body, done = _dechunk(rest)
        return RawResponse(status, headers, body), done
    if "content-length" in headers:
        n = int(headers["content-length"])
        return RawResponse(status, headers, rest[:n]), len(rest) >= n
    return RawResponse(status, headers, rest), False  # read to EOF


def send(host: str, port: int, data: bytes, timeout_s: float = 30.0,
         read_timeout_s: float | None = None) -> RawResponse:
    """Send ``data`` on a new connection and read one answer within ``timeout_s``."""
    t0 = time.monotonic()
    buf = bytearray()
    timed_out = False
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        try:
            s.sendall(data)
        except OSError:
            pass  # the server may answer and close before taking everything
        deadline = t0 + (read_timeout_s or timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            s.settimeout(left)
            try:
                part = s.recv(65536)
            except TimeoutError:
                timed_out = True
                break
            except OSError:
                break
            if not part:
                break
            buf += part
            got, done = _parse(bytes(buf))
            if done and got is not None:
                break
    got, _ = _parse(bytes(buf))
    resp = got or RawResponse(0)
    resp.elapsed_s = time.monotonic() - t0
    resp.raw = bytes(buf)
    resp.timed_out = timed_out
    return resp


def request(method: str, path: str, *, headers: dict[str, str] | list[tuple[str, str]] | None = None,
            body: bytes = b"", host: str = "127.0.0.1", version: str = "HTTP/1.1",
            content_length: bool = True) -> bytes:
    """A well-formed request's bytes (Connection: close), for the cases that need no trickery."""
    items = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
    names = {k.lower() for k, _ in items}
    lines = [f"{method} {path} {version}"]
    if "host" not in names:
        lines.append(f"Host: {host}")
    lines += [f"{k}: {v}" for k, v in items]
    if content_length and body and "content-length" not in names and "transfer-encoding" not in names:
        lines.append(f"Content-Length: {len(body)}")
    if "connection" not in names:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body
