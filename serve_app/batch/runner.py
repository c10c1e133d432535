"""The batch runner: one per gateway replica, it runs batches through the gateway's own pipeline.

Each line is one call of ``Pipeline.answer_line`` in this process (its ``Answer`` read whole),
with the batch creator's key moved to the batch tier (``AppConfig.batch_tier``) when that tier runs
later than the key's own: the line passes the same admission (limits, budgets, shedding; the
flow-control queue's lowest band) and accounting (usage, metrics) as live traffic, and reaches the
engine at the batch tier's priority. The runner imports nothing HTTP: it consumes the same domain
``Answer`` as the HTTP routes.
A line refused with 429 or 503 is retried after a back-off that doubles up to
``gateway.batch.backoff_max_s`` (or the Retry-After, if longer): the runner yields capacity to the
interactive tiers instead of failing its lines.

Runners on several replicas share the batches through the store: a runner claims a batch by its
lease and renews it about every second while it runs it, so two replicas never run the same batch,
and a dead runner's batch is taken over once the lease lapses. Answers are appended to the result
files (fsynced, keyed by ``custom_id``) before they count; a resumed batch skips the ids already
written, so after a crash no line is lost or answered twice (a line in flight at the crash runs
again, but is written once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from serve_app import errors
from serve_app.batch.batches import ENDPOINTS, Batch, BatchStore, Line, parse_input
from serve_app.config import AppConfig, KeyRecord
from serve_app.metrics import BatchMetrics
from serve_app.protocol import ENDPOINTS as ENDPOINT_TABLE
from serve_app.protocol import Answer, Endpoint
from serve_app.state.files import FileStore, ResultFile

logger = logging.getLogger("ray.serve")

# ``Pipeline.answer_line``: one request of a key on an endpoint (body, its size, its arrival
# time), to the gateway's answer.
Handle = Callable[[KeyRecord, Endpoint, dict[str, Any], int, float], Awaitable[Answer]]
KeyLookup = Callable[[str], KeyRecord | None]
TICK_S = 1.0  # how often a running batch renews its lease, saves its progress, reads a cancel
RETRY_FIRST_S = 0.5


class LeaseLost(Exception):
    """Another runner holds the batch now (this one stalled past its lease): stop, write nothing."""


class KeyGone(Exception):
    """The key that created the batch is revoked or expired: none of its lines starts any more."""


KEY_GONE = ("key_revoked", "the key that created this batch was revoked or has expired; no more "
            "of its requests ran")


def error_record(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An error-file line for a request that got no answer."""
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def answer_record(custom_id: str, status: int, body: bytes) -> dict[str, Any]:
    """A result line for a request the gateway answered (output file when 2xx, else errors)."""
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = body.decode("utf-8", "replace")
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": secrets.token_hex(16),
                         "body": parsed}, "error": None}


def _tokens(record: dict[str, Any]) -> tuple[int, int]:
    """(input, output) tokens an answer's usage reports (chat, embeddings and responses)."""
    body = (record.get("response") or {}).get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    inp = usage.get("prompt_tokens", usage.get("input_tokens", 0))
    out = usage.get("completion_tokens", usage.get("output_tokens", 0))
    return (inp if isinstance(inp, int) else 0), (out if isinstance(out, int) else 0)


class BatchRunner:
    """Claims batches from ``store`` and runs them, ``gateway.batch.max_active`` at a time."""

    def __init__(self, cfg: AppConfig, files: FileStore, store: BatchStore, handle: Handle,
                 keys: KeyLookup, metrics: BatchMetrics | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.bcfg = cfg.gateway.batch
        self.files = files
        self.store = store
        self.handle = handle
        self.keys = keys
        self.metrics = metrics
        self.clock = clock
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.tier = cfg.batch_tier
        self.max_body_bytes = cfg.gateway.http.max_body_bytes  # a line's body: the HTTP API's limit
        self.running: dict[str, asyncio.Task[None]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._pending: dict[str, int] = {}
        self._writes: set[asyncio.Future[None]] = set()  # appends under way (``_append``)

    # ---- the replica's loop ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop every batch where it is (each resumes later, here or on another replica)."""
        tasks = [t for t in (self._loop_task, *self.running.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # the store is down for a moment: try again at the next poll
                logger.warning("batch runner: poll failed", exc_info=True)
            await asyncio.sleep(self.bcfg.poll_s)

    async def poll_once(self) -> None:
        """Claim and start the batches this replica has room for."""
        for batch_id in await self.store.active():
            if len(self.running) >= self.bcfg.max_active:
                return
            if batch_id in self.running:
                continue
            if await self.store.claim(batch_id, self.holder, self.bcfg.lease_s):
                task = asyncio.get_running_loop().create_task(self._guarded(batch_id))
                self.running[batch_id] = task

    async def _guarded(self, batch_id: str) -> None:
        try:
            await self.run_batch(batch_id)
        except LeaseLost:
            logger.warning("batch %s: lease lost; another runner has it", batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch %s: runner failed; it resumes at the next poll", batch_id)
        finally:
            self.running.pop(batch_id, None)
            self._pending.pop(batch_id, None)
            self._report_pending()
            with contextlib.suppress(Exception):
                await asyncio.shield(self.store.release(batch_id, self.holder))

    # ---- one batch -----------------------------------------------------------------------------
    async def run_batch(self, batch_id: str) -> None:
        """Run the batch (claimed by this runner) from wherever it stands to a final status, or
        until it is cancelled here (``stop``) or its lease is lost."""
        b = await self.store.load(batch_id)
        if b is None or b.done:
            return
        out = ResultFile(self.files.data_path(b.output_path))
        err = ResultFile(self.files.data_path(b.error_path))
        try:
            await self._run(b, out, err)
        finally:
            out.close()
            err.close()

    async def _run(self, b: Batch, out: ResultFile, err: ResultFile) -> None:
        lines: list[Line] = []
        try:
            data = await asyncio.to_thread(self.files.data_path(b.input_file_id).read_bytes)
        except FileNotFoundError:
            data = None
        if b.status == "validating":
            if await self.store.cancel_requested(b.id):
                out.open(truncate=True)
                err.open(truncate=True)
                b.move("cancelling", self.clock())
                await self._finish(b, out, err, "cancelled")
                return
            if data is None:
                await self._fail(b, "input_file_missing", "the input file was deleted")
                return
            lines, fatal = parse_input(data, b.endpoint, self.bcfg.max_lines, self.max_body_bytes)
            if fatal:
                b.errors = fatal
                b.move("failed", self.clock())
                await self._save_final(b)
                return
            # Lines that cannot run go to the error file now, once (a restart here redoes it).
            out.open(truncate=True)
            err.open(truncate=True)
            for line in lines:
                if line.error is not None:
                    await self._append(err, error_record(line.custom_id, "invalid_request",
                                                         f"line {line.number}: {line.error}"))
            b.total, b.completed, b.failed = len(lines), 0, err.lines
            b.move("in_progress", self.clock())
            await self.store.save(b)
        else:
            if data is not None:
                lines, _ = parse_input(data, b.endpoint, self.bcfg.max_lines, self.max_body_bytes)
            out.open()
            err.open()
            b.completed, b.failed = out.lines, err.lines
            if data is None and b.status == "in_progress":
                # Deleted under a running batch (a restart, another replica picked it up): what
                # ran is kept, and the batch ends as cancelled, saying why. It used to be moved to
                # failed, which the state machine refuses: the runner retried it at every poll.
                b.errors = [{"code": "input_file_missing", "message": "the input file was deleted "
                             "while the batch ran", "param": "input_file_id", "line": None}]
                b.move("cancelling", self.clock())
        if b.status == "in_progress":
            done = out.open_ids | err.open_ids
            pending = deque(ln for ln in lines if ln.error is None and ln.custom_id not in done)
            await self._work(b, pending, out, err)
        final = {"in_progress": "completed", "finalizing": "completed",
                 "cancelling": "cancelled", "expired": "expired"}[b.status]
        await self._finish(b, out, err, final)

    async def _work(self, b: Batch, pending: deque[Line], out: ResultFile,
                    err: ResultFile) -> None:
        """Answer ``pending`` with ``concurrency`` workers; every tick renew the lease, save the
        progress, and stop early on a cancel, at the expiry, or when the batch's key is revoked
        or expires (checked before every attempt of every line). Every line that does not run
        gets an error record: none is lost."""
        endpoint = ENDPOINT_TABLE[ENDPOINTS[b.endpoint]]
        inflight: dict[int, Line] = {}  # each worker's line
        written: set[str] = set()  # custom_ids whose record is written (or being written)

        async def worker(n: int) -> None:
            while pending:
                line = pending.popleft()
                inflight[n] = line
                try:
                    await self._line(b, line, endpoint, out, err, written)
                except KeyGone:
                    pending.appendleft(line)  # it never started
                    raise
                finally:
                    inflight.pop(n, None)

        async def stop_all(code: str, message: str) -> None:
            """Cancel the workers; every line not answered gets an error record."""
            started = list(inflight.values())  # a cancelled worker forgets its line
            await _cancel(workers)
            for line in [*started, *pending]:
                assert line.custom_id is not None
                if line.custom_id not in written:
                    written.add(line.custom_id)
                    await self._append(err, error_record(line.custom_id, code, message))
            inflight.clear()
            pending.clear()

        if not pending:
            return
        workers = [asyncio.create_task(worker(n))
                   for n in range(min(self.bcfg.concurrency, len(pending)))]
        try:
            while True:
                finished, _ = await asyncio.wait(workers, timeout=TICK_S)
                for t in finished:
                    exc = t.exception()
                    if isinstance(exc, KeyGone):
                        await stop_all(*KEY_GONE)
                        b.errors = [{"code": KEY_GONE[0], "message": KEY_GONE[1], "param": None,
                                     "line": None}]
                        b.move("cancelling", self.clock())
                        await self.store.save(b)
                        return
                    if exc is not None:
                        raise exc
                if len(finished) == len(workers):
                    return
                if not await self.store.claim(b.id, self.holder, self.bcfg.lease_s):
                    raise LeaseLost(b.id)
                self._pending[b.id] = len(pending) + sum(not t.done() for t in workers)
                self._report_pending()
                if await self.store.cancel_requested(b.id):
                    b.move("cancelling", self.clock())
                    await self.store.save(b)
                    return
                if self.clock() >= b.expires_at:
                    # Lines waiting, in flight or in a back-off alike get their record.
                    await stop_all("batch_expired", "the batch expired before this request ran")
                    b.move("expired", self.clock())
                    return
                b.completed, b.failed = out.lines, err.lines
                await self.store.save(b)
        finally:
            await _cancel(workers)

    def _key_now(self, b: Batch) -> KeyRecord:
        """The batch's key as it is now (its tier, models, limits and budget), or ``KeyGone``."""
        key = self.keys(b.key_id)
        if key is None or key.expired(self.clock()):
            raise KeyGone(b.key_id)
        return key

    async def _line(self, b: Batch, line: Line, endpoint: Endpoint, out: ResultFile,
                    err: ResultFile, written: set[str]) -> None:
        """One line to its result, retried (after a back-off) while it is refused for load; a
        spent budget is final (its record says so), and a revoked key stops it before it starts."""
        assert line.body is not None and line.custom_id is not None
        key_id = b.key_id
        delay = RETRY_FIRST_S
        while True:
            key = self._key_now(b)  # at every attempt: a revocation stops the next one
            try:
                if endpoint.body_check is not None:
                    endpoint.body_check(line.body)
                answer = await self.handle(self._run_key(key), endpoint, line.body,
                                           len(json.dumps(line.body)), self.clock())
                status, body = answer.status, await answer.read()
                wait = 0.0
            except errors.QuotaExceeded as exc:  # spent until its period resets: no retry
                status, body, wait = exc.status, json.dumps(exc.to_body()).encode(), -1.0
            except errors.Refused as exc:
                status, body = exc.status, b""
                wait = exc.retry_after_s or 0.0
            except errors.ServeAppError as exc:
                status, body, wait = exc.status, json.dumps(exc.to_body()).encode(), 0.0
            except Exception:  # a bug of ours: this line fails, the batch goes on
                logger.exception("batch %s: line %s failed", b.id, line.custom_id)
                err_500 = errors.InternalError("The server had an error processing the request.")
                status, body, wait = 500, json.dumps(err_500.to_body()).encode(), 0.0
            if status in (429, 503) and wait >= 0:
                if self.metrics is not None:
                    self.metrics.line_done(key_id=key_id, endpoint=b.endpoint, outcome="retried")
                await asyncio.sleep(min(max(delay, wait), self.bcfg.backoff_max_s))
                delay = min(delay * 2, self.bcfg.backoff_max_s)
                continue
            record = answer_record(line.custom_id, status, body)
            break
        ok = 200 <= status < 300
        written.add(line.custom_id)  # the append below finishes even if this task is cancelled
        await self._append(out if ok else err, record)
        inp, outp = _tokens(record)
        b.usage = {"input_tokens": b.usage["input_tokens"] + inp,
                   "output_tokens": b.usage["output_tokens"] + outp,
                   "total_tokens": b.usage["total_tokens"] + inp + outp}
        if self.metrics is not None:
            self.metrics.line_done(key_id=key_id, endpoint=b.endpoint,
                                   outcome="completed" if ok else "failed")

    def _run_key(self, key: KeyRecord) -> KeyRecord:
        """The creator's key at the batch tier, unless its own tier already runs later."""
        tiers = self.cfg.tiers
        own, batch = tiers.get(key.tier), tiers[self.tier]
        if own is not None and own.priority >= batch.priority:
            return key
        return key.model_copy(update={"tier": self.tier})

    async def _append(self, f: ResultFile, record: dict[str, Any]) -> None:
        # In a thread (fsync), shielded: a cancelled line is written whole, and counted once
        # ``_finish`` has waited for it.
        write = asyncio.ensure_future(asyncio.to_thread(f.append, record))
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)
        await asyncio.shield(write)

    async def _fail(self, b: Batch, code: str, message: str) -> None:
        b.errors = [{"code": code, "message": message, "param": "input_file_id", "line": None}]
        b.move("failed", self.clock())
        await self._save_final(b)

    async def _finish(self, b: Batch, out: ResultFile, err: ResultFile, final: str) -> None:
        """Register the result files and take the batch to ``final``."""
        await asyncio.gather(*self._writes)
        if b.status == "in_progress":
            b.move("finalizing", self.clock())
            await self.store.save(b)
        b.completed, b.failed = out.lines, err.lines
        if out.lines:
            self.files.register(b.output_path, b.owner, f"{b.id}_output.jsonl", "batch_output")
            b.output_file_id = b.output_path
        if err.lines:
            self.files.register(b.error_path, b.owner, f"{b.id}_error.jsonl", "batch_output")
            b.error_file_id = b.error_path
        if b.status != final:
            b.move(final, self.clock())
        await self._save_final(b)

    async def _save_final(self, b: Batch) -> None:
        await self.store.save(b)
        if self.metrics is not None:
            self.metrics.batch_done(b.status)
        logger.info("batch %s %s: %d completed, %d failed of %d", b.id, b.status, b.completed,
                    b.failed, b.total)

    def _report_pending(self) -> None:
        if self.metrics is not None:
            self.metrics.pending_now(sum(self._pending.values()))


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
