"""Batches: OpenAI's ``batch`` object, its state machine, the parsing of its input lines, and
the durable store of its state (JSON files on the embedded default, Redis when configured).

    validating -> in_progress -> finalizing -> completed
    validating -> failed                         (the file as a whole is unusable)
    validating | in_progress -> cancelling -> cancelled
    in_progress -> expired                       (past completion_window)

The store also holds each batch's lease (which runner runs it, until when) and its cancel
request, apart from the state itself: a runner writes its state often, and a cancel from another
replica must not be lost under those writes.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from serve_app import errors
from serve_app.protocol import json_offence

# The Batch API's endpoints and the endpoint-table rows that serve them.
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/embeddings": "embeddings",
             "/v1/responses": "responses"}
COMPLETION_WINDOWS = {"24h": 24 * 3600}
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "cancelling",
            "cancelled", "expired")
_NEXT: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "failed", "cancelling"}),
    "in_progress": frozenset({"finalizing", "cancelling", "expired"}),
    "finalizing": frozenset({"completed"}),
    "cancelling": frozenset({"cancelled"}),
}
MAX_CUSTOM_ID = 512
MAX_METADATA = 16


class BadTransition(RuntimeError):
    """A status change the state machine does not allow (a bug, never a client's doing)."""


@dataclass
class Batch:
    """One batch: OpenAI's fields, and what only the gateway knows (owner, key, result files)."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    owner: str  # the tenant whose files these are
    key_id: str  # the key its lines are charged to
    output_path: str  # the result files' ids, chosen at creation, exposed when finalized
    error_path: str
    status: str = "validating"
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    usage: dict[str, int] = field(default_factory=lambda: {
        "input_tokens": 0, "output_tokens": 0, "total_tokens": 0})

    def move(self, status: str, now: float) -> None:
        """Change status along the state machine and stamp its ``<status>_at``."""
        if status not in _NEXT.get(self.status, frozenset()):
            raise BadTransition(f"batch {self.id}: {self.status} -> {status}")
        self.status = status
        setattr(self, f"{status}_at", int(now))

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def public(self, cancel_requested: bool = False) -> dict[str, Any]:
        """The object OpenAI's SDK reads (``openai.types.Batch``)."""
        status = self.status
        cancelling_at = self.cancelling_at
        if cancel_requested and status in ("validating", "in_progress"):
            status = "cancelling"  # the runner has not seen it yet
            cancelling_at = cancelling_at or int(time.time())
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": None if not self.errors else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": status, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": self.created_at,
            "in_progress_at": self.in_progress_at, "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at, "completed_at": self.completed_at,
            "failed_at": self.failed_at, "expired_at": self.expired_at,
            "cancelling_at": cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed,
                               "failed": self.failed},
            "usage": {**self.usage, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}},
            "metadata": self.metadata,
        }

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Batch:
        return cls(**json.loads(raw))


def check_create(body: dict[str, Any]) -> tuple[str, str, str, dict[str, str] | None]:
    """``POST /v1/batches``'s body: (input_file_id, endpoint, completion_window, metadata), or a
    400 naming the field."""
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise errors.InvalidRequest("input_file_id must be a file id", param="input_file_id")
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise errors.InvalidRequest(
            f"endpoint must be one of {sorted(ENDPOINTS)}, not {str(endpoint)[:80]!r}",
            param="endpoint")
    window = body.get("completion_window")
    if not isinstance(window, str) or window not in COMPLETION_WINDOWS:
        raise errors.InvalidRequest(
            f"completion_window must be one of {sorted(COMPLETION_WINDOWS)}, "
            f"not {str(window)[:80]!r}", param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and len(metadata) <= MAX_METADATA
        and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items())
    ):
        raise errors.InvalidRequest(
            f"metadata must be at most {MAX_METADATA} string pairs (keys up to 64 characters, "
            "values up to 512)", param="metadata")
    return file_id, endpoint, window, metadata


@dataclass(frozen=True)
class Line:
    """One input line: a request to run, or why it cannot run (``error``)."""

    number: int  # 1-based, as OpenAI's errors name lines
    custom_id: str | None
    body: dict[str, Any] | None = None
    error: str | None = None


def parse_line(number: int, raw: bytes, url: str) -> Line:
    """One line of a batch input file against the batch's endpoint ``url``."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return Line(number, None, error="the line is not valid JSON")
    if not isinstance(obj, dict):
        return Line(number, None, error="the line is not a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        return Line(number, None,
                    error=f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters")
    if obj.get("method") != "POST":
        return Line(number, cid, error="method must be POST")
    if obj.get("url") != url:
        return Line(number, cid, error=f"url must be the batch's endpoint {url}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return Line(number, cid, error="body must be a JSON object")
    offence = json_offence(body)
    if offence is not None:
        return Line(number, cid, error=f"body: {offence}")
    if body.get("stream"):
        return Line(number, cid, error="stream is not supported in a batch")
    if not isinstance(body.get("model"), str):
        return Line(number, cid, error="body.model must be a model name")
    return Line(number, cid, body=body)


def parse_input(data: bytes, url: str, max_lines: int) -> tuple[list[Line], list[dict[str, Any]]]:
    """Every non-blank line of an input file, and the errors that fail the whole batch (no
    lines, too many, a repeated ``custom_id``: results are keyed by it)."""
    lines = [parse_line(n, raw, url)
             for n, raw in enumerate(data.splitlines(), start=1) if raw.strip()]
    if not lines:
        return lines, [{"code": "empty_file", "message": "the input file has no requests",
                        "param": "input_file_id", "line": None}]
    if len(lines) > max_lines:
        return lines, [{"code": "too_many_requests",
                        "message": f"the input file has {len(lines)} requests; at most "
                                   f"{max_lines} are allowed", "param": "input_file_id",
                        "line": None}]
    seen: dict[str, int] = {}
    for line in lines:
        if line.custom_id is None:
            continue
        if line.custom_id in seen:
            return lines, [{"code": "duplicate_custom_id",
                            "message": f"custom_id {line.custom_id[:80]!r} of line {line.number} "
                                       f"is also on line {seen[line.custom_id]}",
                            "param": "custom_id", "line": line.number}]
        seen[line.custom_id] = line.number
    return lines, []


class BatchStore(Protocol):
    """The batches' durable state, lease and cancel requests, shared by the gateway replicas.

    ``claim`` takes a batch's lease for ``holder`` (or renews it if ``holder`` has it) and says
    whether it did; a lease lapses ``lease_s`` after its last claim, so a dead runner's batch is
    taken over."""

    async def save(self, batch: Batch) -> None: ...
    async def load(self, batch_id: str) -> Batch | None: ...
    async def owned(self, owner: str) -> list[Batch]: ...
    async def active(self) -> list[str]: ...
    async def recent(self, limit: int) -> list[Batch]: ...
    async def request_cancel(self, batch_id: str) -> None: ...
    async def cancel_requested(self, batch_id: str) -> bool: ...
    async def claim(self, batch_id: str, holder: str, lease_s: float) -> bool: ...
    async def release(self, batch_id: str, holder: str) -> None: ...
    async def close(self) -> None: ...


class FileBatchStore:
    """Batches as JSON files under ``<root>/batches``; leases under an ``flock``, so replicas on
    one machine never both hold one. The embedded default's store without Redis."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = self.dir / ".lock"

    def _path(self, batch_id: str, suffix: str) -> Path:
        return self.dir / f"{batch_id}{suffix}"

    async def save(self, batch: Batch) -> None:
        await asyncio.to_thread(_atomic_text, self._path(batch.id, ".json"), batch.to_json())

    async def load(self, batch_id: str) -> Batch | None:
        if not _valid_batch_id(batch_id):
            return None
        try:
            return Batch.from_json(self._path(batch_id, ".json").read_bytes())
        except FileNotFoundError:
            return None

    def _all(self) -> Iterator[Batch]:
        for p in self.dir.glob("*.json"):
            try:
                yield Batch.from_json(p.read_bytes())
            except (FileNotFoundError, ValueError, TypeError):
                continue

    async def owned(self, owner: str) -> list[Batch]:
        found = [b for b in self._all() if b.owner == owner]
        return sorted(found, key=lambda b: (b.created_at, b.id), reverse=True)

    async def recent(self, limit: int) -> list[Batch]:
        return sorted(self._all(), key=lambda b: (b.created_at, b.id), reverse=True)[:limit]

    async def active(self) -> list[str]:
        live = sorted((b for b in self._all() if not b.done), key=lambda b: (b.created_at, b.id))
        return [b.id for b in live]

    async def request_cancel(self, batch_id: str) -> None:
        self._path(batch_id, ".cancel").touch()

    async def cancel_requested(self, batch_id: str) -> bool:
        return self._path(batch_id, ".cancel").exists()

    async def claim(self, batch_id: str, holder: str, lease_s: float) -> bool:
        return await asyncio.to_thread(self._claim, batch_id, holder, lease_s)

    def _claim(self, batch_id: str, holder: str, lease_s: float) -> bool:
        path = self._path(batch_id, ".lease")
        with open(self._lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                lease = json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                lease = None
            now = time.time()
            if lease is not None and lease["holder"] != holder and lease["until"] > now:
                return False
            _atomic_text(path, json.dumps({"holder": holder, "until": now + lease_s}))
            return True

    async def release(self, batch_id: str, holder: str) -> None:
        await asyncio.to_thread(self._release, batch_id, holder)

    def _release(self, batch_id: str, holder: str) -> None:
        path = self._path(batch_id, ".lease")
        with open(self._lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if json.loads(path.read_text())["holder"] == holder:
                    path.unlink()
            except (FileNotFoundError, ValueError, KeyError):
                pass

    async def close(self) -> None:
        return None


def _valid_batch_id(batch_id: str) -> bool:
    return 0 < len(batch_id) <= 64 and all(c.isalnum() or c in "_-" for c in batch_id)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_PREFIX = "serve_app:batch:"
# Take the lease if it is free or already ours; renew it either way.
_CLAIM_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


class RedisBatchStore:
    """Batches in Redis (``gateway.redis_url``): shared by every gateway replica on every node."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as redis

        self._redis = redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=2.0)
        self._claim = self._redis.register_script(_CLAIM_LUA)
        self._release = self._redis.register_script(_RELEASE_LUA)

    async def save(self, batch: Batch) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(_PREFIX + batch.id, batch.to_json())
        pipe.zadd(f"{_PREFIX}owner:{batch.owner}", {batch.id: batch.created_at})
        pipe.zadd(f"{_PREFIX}all", {batch.id: batch.created_at})
        if batch.done:
            pipe.srem(_PREFIX + "active", batch.id)
        else:
            pipe.sadd(_PREFIX + "active", batch.id)
        await pipe.execute()

    async def load(self, batch_id: str) -> Batch | None:
        if not _valid_batch_id(batch_id):
            return None
        raw = await self._redis.get(_PREFIX + batch_id)
        return None if raw is None else Batch.from_json(raw)

    async def owned(self, owner: str) -> list[Batch]:
        return await self._listed(f"{_PREFIX}owner:{owner}", -1)

    async def recent(self, limit: int) -> list[Batch]:
        return await self._listed(f"{_PREFIX}all", limit - 1)

    async def _listed(self, index: str, last: int) -> list[Batch]:
        ids = await self._redis.zrevrange(index, 0, last)
        if not ids:
            return []
        raws = await self._redis.mget([_PREFIX + _text(i) for i in ids])
        return [Batch.from_json(r) for r in raws if r is not None]

    async def active(self) -> list[str]:
        return sorted(_text(i) for i in await self._redis.smembers(_PREFIX + "active"))

    async def request_cancel(self, batch_id: str) -> None:
        await self._redis.set(f"{_PREFIX}cancel:{batch_id}", b"1")

    async def cancel_requested(self, batch_id: str) -> bool:
        return bool(await self._redis.exists(f"{_PREFIX}cancel:{batch_id}"))

    async def claim(self, batch_id: str, holder: str, lease_s: float) -> bool:
        got = await self._claim(keys=[f"{_PREFIX}lease:{batch_id}"],
                                args=[holder, int(lease_s * 1000)])
        return bool(got)

    async def release(self, batch_id: str, holder: str) -> None:
        await self._release(keys=[f"{_PREFIX}lease:{batch_id}"], args=[holder])

    async def close(self) -> None:
        await self._redis.aclose()
