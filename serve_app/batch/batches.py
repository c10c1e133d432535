"""Batches: OpenAI's ``batch`` object, its state machine, the parsing of its input lines, and
the store of batches over the state's documents (``state/batches.py``: JSON files on the embedded
default, Redis when configured).

    validating -> in_progress -> finalizing -> completed
    validating -> failed                         (the file as a whole is unusable)
    validating | in_progress -> cancelling -> cancelled
    in_progress -> expired                       (past completion_window)

The store also holds each batch's lease (which runner runs it, until when) and its cancel
request, apart from the state itself: a runner writes its state often, and a cancel from another
replica must not be lost under those writes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from serve_app import errors
from serve_app.bodies import check_fields, check_size, parse_body
from serve_app.config import HttpConfig
from serve_app.protocol import json_offence
from serve_app.state.batches import TERMINAL, BatchDocs

# The Batch API's endpoints and the endpoint-table rows that serve them.
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/embeddings": "embeddings",
             "/v1/responses": "responses"}
COMPLETION_WINDOWS = {"24h": 24 * 3600}
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


DEFAULT_MAX_BODY = HttpConfig.model_fields["max_body_bytes"].default


def parse_line(number: int, raw: bytes, url: str, max_body_bytes: int = DEFAULT_MAX_BODY) -> Line:
    """One line of a batch input file against the batch's endpoint ``url``. Its body passes the
    same rules as an HTTP request's (``bodies``): strict JSON (depth, 64-bit integers, no NaN or
    lone surrogates), at most ``max_body_bytes``, no field the gateway owns."""
    try:
        obj = parse_body(raw)
    except errors.InvalidRequest as exc:
        return Line(number, None, error=_lax_reason(raw) or exc.message)
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
    try:
        check_size(len(orjson.dumps(body)), max_body_bytes)
        check_fields(body)
    except errors.ServeAppError as exc:
        return Line(number, cid, error=f"body: {exc.message}")
    if body.get("stream"):
        return Line(number, cid, error="stream is not supported in a batch")
    if not isinstance(body.get("model"), str):
        return Line(number, cid, error="body.model must be a model name")
    return Line(number, cid, body=body)


def _lax_reason(raw: bytes) -> str | None:
    """What a line that is valid to a lax parser lacks (an object; its body's offence), in the
    words the batch API has always used; None when it is not JSON at all."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return "the line is not valid JSON"
    if not isinstance(obj, dict):
        return "the line is not a JSON object"
    body = obj.get("body")
    offence = json_offence(body) if isinstance(body, dict) else None
    return f"body: {offence}" if offence is not None else None


def parse_input(data: bytes, url: str, max_lines: int, max_body_bytes: int = DEFAULT_MAX_BODY,
                ) -> tuple[list[Line], list[dict[str, Any]]]:
    """Every non-blank line of an input file, and the errors that fail the whole batch (no
    lines, too many, a repeated ``custom_id``: results are keyed by it)."""
    lines = [parse_line(n, raw, url, max_body_bytes)
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


class BatchStore:
    """The batches as the runner and the routes use them: ``Batch`` objects over the state's
    documents (``state.batches``: JSON files, or Redis when configured), with each batch's lease
    and cancel request. ``claim`` takes a batch's lease for ``holder`` (or renews it if ``holder``
    has it) and says whether it did; a lease lapses ``lease_s`` after its last claim, so a dead
    runner's batch is taken over."""

    def __init__(self, docs: BatchDocs) -> None:
        self.docs = docs

    async def save(self, batch: Batch) -> None:
        await self.docs.save(batch.id, batch.owner, batch.created_at, batch.done, batch.to_json())

    async def load(self, batch_id: str) -> Batch | None:
        raw = await self.docs.load(batch_id)
        return None if raw is None else Batch.from_json(raw)

    async def owned(self, owner: str) -> list[Batch]:
        return _decoded(await self.docs.owned(owner))

    async def recent(self, limit: int) -> list[Batch]:
        return _decoded(await self.docs.recent(limit))

    async def active(self) -> list[str]:
        return await self.docs.active()

    async def request_cancel(self, batch_id: str) -> None:
        await self.docs.request_cancel(batch_id)

    async def cancel_requested(self, batch_id: str) -> bool:
        return await self.docs.cancel_requested(batch_id)

    async def claim(self, batch_id: str, holder: str, lease_s: float) -> bool:
        return await self.docs.claim(batch_id, holder, lease_s)

    async def release(self, batch_id: str, holder: str) -> None:
        await self.docs.release(batch_id, holder)


def _decoded(raws: list[bytes]) -> list[Batch]:
    """The batches of ``raws``, skipping any document that is not one (as a listing always has)."""
    out = []
    for raw in raws:
        try:
            out.append(Batch.from_json(raw))
        except (ValueError, TypeError):
            continue
    return out
