"""Stored Responses: keep each answer of ``POST /v1/responses`` (``store``, OpenAI's default) in the
state layer, unroll ``previous_response_id`` into the model's input, and run ``background``
responses past their request.

The model sees a stateless request (``chain.parse_turn``); what makes the chain is the stored
document, so a turn may land on any gateway replica and any model replica, after any restart.
Every stored response belongs to its key's tenant: another tenant's id is unknown (404), never
forbidden, so its existence leaks nothing.

A background run (``BackgroundRun``) outlives its request. It re-checks its key and its cancel
request at least every ``heartbeat_s`` (a revoked or expired key stops it), writes its events as
they come (``GET ...?stream=true&starting_after=N`` replays them), and leaves a heartbeat, so a run
whose gateway replica died is failed, with a message, when it is next read.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

from serve_app import errors
from serve_app.config import KeyRecord, ResponsesConfig
from serve_app.gateway.responses.chain import (
    FINAL_EVENTS,
    TERMINAL,
    EventSplitter,
    Turn,
    client_view,
    dump,
    event_data,
    event_kind,
    new_doc,
    parse_turn,
)
from serve_app.gateway.routing.affinity import affinity_key
from serve_app.protocol import Answer, Endpoint
from serve_app.state.responses import ResponseDocs, valid_response_id

logger = logging.getLogger("ray.serve")
POLL_S = 0.05  # how often a replaying stream looks for a background run's next events
CANCEL_WAIT_S = 5.0  # how long a cancel waits for the run to record it
# An incomplete response (it reached max_output_tokens) is continued as OpenAI does.
CONTINUABLE = frozenset({"completed", "incomplete"})
STREAM_ONLY = frozenset({"cache-control", "x-accel-buffering"})

KeyById = Callable[[str], KeyRecord | None]


def _interrupted(doc: dict[str, Any], message: str, code: str, status: str = "failed") -> None:
    doc["response"]["status"] = status
    if status == "failed":
        doc["response"]["error"] = {"code": code, "message": message}


class StoredResponses:
    """The stored responses of one gateway replica's routes, over the shared ``ResponseDocs``."""

    def __init__(self, store: ResponseDocs, cfg: ResponsesConfig, key_by_id: KeyById,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.cfg = cfg
        self._key_by_id = key_by_id
        self._clock = clock
        self._running: dict[str, BackgroundRun] = {}

    # ---- reading ---------------------------------------------------------------------------
    async def owned(self, key: KeyRecord, resp_id: str) -> dict[str, Any] | None:
        """The stored document ``resp_id`` if it belongs to ``key``'s tenant, else None."""
        if not valid_response_id(resp_id):
            return None
        raw = await self.store.get(resp_id)
        if raw is None:
            return None
        doc: dict[str, Any] = json.loads(raw)
        if doc.get("owner") != key.owner:
            return None
        await self._fail_if_stale(doc)
        return doc

    async def get(self, key: KeyRecord, resp_id: str) -> dict[str, Any]:
        doc = await self.owned(key, resp_id)
        if doc is None:
            raise errors.NotFound(f"No response found with id {resp_id!r}.", param="response_id")
        return doc

    async def _fail_if_stale(self, doc: dict[str, Any]) -> None:
        """A background response whose run stopped writing (its replica died) is failed now."""
        if (doc["response"].get("status") in TERMINAL or doc["id"] in self._running
                or self._clock() - float(doc.get("heartbeat_at") or 0) < self.cfg.stale_after_s):
            return
        _interrupted(doc, "the gateway replica that ran this background response stopped before "
                     "it finished; create the response again", "interrupted")
        await self.store.put(doc["id"], dump(doc), self.cfg.ttl_s)

    # ---- a new turn ------------------------------------------------------------------------
    async def prepare(self, key: KeyRecord, endpoint: Endpoint, body: dict[str, Any],
                      headers: Mapping[str, str]) -> Turn:
        """The turn ``body`` asks for, its ``previous_response_id`` resolved for ``key``'s tenant;
        its affinity key is its chain's (the first turn's, made from its headers and body)."""
        prev_id = body.get("previous_response_id")
        previous = None
        if prev_id is not None:
            if not isinstance(prev_id, str):
                raise errors.InvalidRequest("'previous_response_id' must be a string",
                                            param="previous_response_id")
            previous = await self.owned(key, prev_id)
            if previous is None:
                raise errors.InvalidRequest(f"Previous response with id {prev_id!r} not found.",
                                            param="previous_response_id")
            if previous["response"].get("status") not in CONTINUABLE:
                raise errors.InvalidRequest(
                    f"Previous response {prev_id!r} is {previous['response'].get('status')}; only "
                    "a completed or incomplete response can be continued",
                    param="previous_response_id")
        turn = parse_turn(body, previous)
        if turn.affinity is None:
            turn.affinity = affinity_key(key.owner, endpoint, headers, body)
        return turn

    async def keep(self, key: KeyRecord, turn: Turn, answer: Answer) -> Answer:
        """``answer`` to the client, stored first when ``turn.store`` (a stream's response is
        stored before its final event goes out, so the next turn can name it at once)."""
        if not turn.store or answer.status != 200:
            return answer
        if answer.events is None:
            response = json.loads(answer.body or b"{}")
            doc = new_doc(response, turn, key.owner, key.id)
            await self._save(doc)
            return dataclasses.replace(answer, body=dump(doc["response"]))
        events, finish = answer.events, answer.finish

        async def kept() -> AsyncGenerator[bytes, None]:
            splitter = EventSplitter()
            async for chunk in events:
                for ev in splitter.feed(chunk):
                    if event_kind(ev) in FINAL_EVENTS:
                        response = event_data(ev).get("response")
                        if isinstance(response, dict):
                            await self._save(new_doc(response, turn, key.owner, key.id))
                yield chunk

        gen = kept()

        async def end() -> None:
            try:
                await gen.aclose()
            finally:
                if finish is not None:
                    await finish()

        return dataclasses.replace(answer, events=gen, finish=end)

    async def _save(self, doc: dict[str, Any]) -> None:
        doc["heartbeat_at"] = self._clock()
        try:
            await self.store.put(doc["id"], dump(doc), self.cfg.ttl_s)
        except Exception as exc:  # the answer still goes out; the id will not resolve
            logger.error("response %s not stored: %s", doc["id"], exc.__class__.__name__)

    # ---- background ------------------------------------------------------------------------
    async def start_background(self, key: KeyRecord, turn: Turn, answer: Answer) -> Answer:
        """Run ``answer`` (an admitted stream) past this request; answer with the response as it
        begins, or with its events replayed from the store when the client asked for a stream."""
        if answer.events is None:
            return answer  # the model refused it (e.g. a 400): nothing runs
        run = BackgroundRun(self, key, turn, answer)
        doc = await run.start()
        rid = str(doc["id"])
        self._running[rid] = run
        run.task.add_done_callback(lambda _t: self._running.pop(rid, None))
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in STREAM_ONLY}
        if turn.stream:
            return Answer(200, answer.headers, events=self.replay(doc["id"], -1))
        return Answer(200, headers, body=dump(doc["response"]))

    async def replay(self, resp_id: str, after: int) -> AsyncIterator[bytes]:
        """A background response's events after index ``after``, then those still to come, until
        it ends. Its run writes events before its final state, so nothing is missed at the end."""
        while True:
            events = await self.store.events(resp_id, after)
            for ev in events:
                yield ev
            after += len(events)
            if events:
                continue
            raw = await self.store.get(resp_id)
            doc = json.loads(raw) if raw is not None else None
            if doc is not None and doc["response"].get("status") not in TERMINAL:
                await self._fail_if_stale(doc)
            if doc is None or doc["response"].get("status") in TERMINAL:
                for ev in await self.store.events(resp_id, after):
                    yield ev
                return
            await asyncio.sleep(POLL_S)

    async def stream(self, key: KeyRecord, resp_id: str, starting_after: int | None) -> Answer:
        """``GET /v1/responses/{id}?stream=true``: a background response's events after
        ``starting_after`` (its sequence number), as they were sent."""
        doc = await self.get(key, resp_id)
        if not doc.get("background"):
            raise errors.InvalidRequest("only a background response can be streamed again; GET "
                                        "it without stream", param="stream")
        after = -1 if starting_after is None else starting_after
        if doc["response"].get("status") in TERMINAL:
            count = await self.store.event_count(resp_id)
            if after >= count:
                raise errors.InvalidRequest(
                    f"starting_after ({after}) is past the response's last event "
                    f"({count - 1})", param="starting_after")
        return Answer(200, {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                      events=self.replay(resp_id, after))

    async def cancel(self, key: KeyRecord, resp_id: str) -> dict[str, Any]:
        """Stop a background response; its state as it ended."""
        doc = await self.get(key, resp_id)
        if not doc.get("background"):
            raise errors.InvalidRequest("only a background response can be cancelled",
                                        param="response_id")
        if doc["response"].get("status") in TERMINAL:
            return doc
        run = self._running.get(resp_id)
        if run is not None:
            await run.stop("cancelled")
        else:  # another replica runs it: it sees the request at its next heartbeat
            await self.store.request_cancel(resp_id, self.cfg.ttl_s)
            deadline = self._clock() + CANCEL_WAIT_S + self.cfg.heartbeat_s
            while self._clock() < deadline:
                await asyncio.sleep(POLL_S * 4)
                doc = await self.get(key, resp_id)
                if doc["response"].get("status") in TERMINAL:
                    return doc
        return await self.get(key, resp_id)

    async def delete(self, key: KeyRecord, resp_id: str) -> None:
        doc = await self.get(key, resp_id)
        run = self._running.get(resp_id)
        if run is not None:
            await run.stop("cancelled")
        elif doc["response"].get("status") not in TERMINAL:
            await self.store.request_cancel(resp_id, self.cfg.ttl_s)
        await self.store.delete(resp_id)

    async def close(self) -> None:
        """At the replica's stop: each run still going is failed, with a message saying why."""
        runs = list(self._running.values())
        await asyncio.gather(*(r.stop("interrupted") for r in runs), return_exceptions=True)

    def key_active(self, key_id: str) -> bool:
        key = self._key_by_id(key_id)
        return key is not None and not key.expired(self._clock())


class BackgroundRun:
    """One background response's run: consumes its model stream in a task of its own."""

    def __init__(self, owner: StoredResponses, key: KeyRecord, turn: Turn, answer: Answer) -> None:
        self._owner = owner
        self._key = key
        self._turn = turn
        self._answer = answer
        self._created: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._stopping: str | None = None
        self.task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._run())
        self.doc: dict[str, Any] | None = None

    async def start(self) -> dict[str, Any]:
        """The stored document once the model has begun (its ``response.created``); raises the
        model's error if its stream ended before that."""
        return await asyncio.shield(self._created)

    async def stop(self, why: str) -> None:
        """Stop the run (``cancelled`` by its owner, ``interrupted`` by the replica's stop)."""
        self._stopping = why
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self.task), CANCEL_WAIT_S)

    async def _watch(self) -> None:
        """Every ``heartbeat_s`` while the run goes on, even when the model sends nothing: stop it
        when its key is gone or a cancel was asked for (on any replica), else leave a heartbeat."""
        owner = self._owner
        while True:
            await asyncio.sleep(owner.cfg.heartbeat_s)
            if self.doc is None:
                continue
            why = None
            if not owner.key_active(self._key.id):
                why = "key"
            elif await owner.store.cancel_requested(self.doc["id"]):
                why = "cancelled"
            if why is not None:
                self._stopping = why
                self.task.cancel()
                return
            await owner._save(self.doc)

    async def _run(self) -> None:
        owner, store, ttl = self._owner, self._owner.store, self._owner.cfg.ttl_s
        splitter, pending = EventSplitter(), []
        final: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        stop: str | None = None
        watch = asyncio.get_running_loop().create_task(self._watch())
        assert self._answer.events is not None
        try:
            async for chunk in self._answer.events:
                if self._answer.written is not None:  # its first bytes are in the gateway's hands
                    self._answer.written()
                for ev in splitter.feed(chunk):
                    kind = event_kind(ev)
                    if self.doc is None and kind == "response.created":
                        response = event_data(ev).get("response") or {}
                        self.doc = new_doc(response, self._turn, self._key.owner, self._key.id)
                        await owner._save(self.doc)
                        self._created.set_result(self.doc)
                    elif kind in FINAL_EVENTS:
                        final = event_data(ev).get("response")
                    elif kind == "error":
                        error = event_data(ev)
                    pending.append(ev)
                if self.doc is not None and pending:
                    await store.append(self.doc["id"], pending, ttl)
                    pending = []
        except asyncio.CancelledError:
            stop = self._stopping or "interrupted"
        except Exception as exc:
            logger.error("background response broke: %s", exc.__class__.__name__)
            error = {"code": "server_error", "message": "the model's stream broke; retry"}
        finally:
            watch.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                if self._answer.finish is not None:
                    await self._answer.finish()  # stops the engine's work if it still runs
            await asyncio.shield(self._end(pending, final, error, stop))

    async def _end(self, pending: list[bytes], final: dict[str, Any] | None,
                   error: dict[str, Any] | None, stop: str | None) -> None:
        owner, doc = self._owner, self.doc
        if doc is None:  # it ended before it began: the request that started it gets the error
            if not self._created.done():
                message = (error or {}).get("message") or "the model ended the response early"
                self._created.set_exception(errors.AnswerBroken(str(message)))
            return
        try:
            if pending:
                await owner.store.append(doc["id"], pending, owner.cfg.ttl_s)
            if final is not None and stop is None:
                doc["response"] = client_view(final, self._turn)
            elif stop == "cancelled":
                _interrupted(doc, "", "", status="cancelled")
            elif stop == "key":
                _interrupted(doc, "the API key that created this response was revoked or has "
                             "expired", "key_revoked")
            elif stop == "interrupted":
                _interrupted(doc, "the gateway stopped before this background response finished; "
                             "create it again", "interrupted")
            else:
                message = (error or {}).get("message") or "the model's stream ended early"
                _interrupted(doc, str(message), str((error or {}).get("code") or "server_error"))
            await owner._save(doc)
        except Exception as exc:
            logger.error("background response %s not saved: %s", doc["id"], exc.__class__.__name__)
