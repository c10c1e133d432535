"""The HTTP routes of ``/v1/files`` and ``/v1/batches`` (OpenAI's objects and pagination), thin over
``BatchService``. Every file and batch belongs to the owner of the key that made it
(``KeyRecord.owner``: its tenant, or the key itself when it has none; the two never share a name);
another owner's ids answer 404."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from starlette.datastructures import UploadFile
from starlette.responses import FileResponse
from starlette.types import Message

from serve_app import errors
from serve_app.batch.batches import COMPLETION_WINDOWS, Batch, BatchStore, check_create
from serve_app.bodies import parse_body
from serve_app.config import AppConfig, KeyRecord
from serve_app.gateway.http.read import read_capped, require_json
from serve_app.state.files import PURPOSES, FileStore, new_id

Authenticate = Callable[..., Any]


class BatchService:
    """What the routes do with files and batches; the runner does the rest."""

    def __init__(self, cfg: AppConfig, files: FileStore, store: BatchStore,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.files = files
        self.store = store
        self.clock = clock

    async def create_batch(self, key: KeyRecord, body: dict[str, Any]) -> dict[str, Any]:
        file_id, endpoint, window, metadata = check_create(body)
        f = await asyncio.to_thread(self.files.get, key.owner, file_id)
        if f["purpose"] != "batch":
            raise errors.InvalidRequest(f"file {file_id} has purpose {f['purpose']!r}, not 'batch'",
                                        param="input_file_id")
        open_ = [b for b in await self.store.owned(key.owner) if not b.done]
        bcfg = self.cfg.gateway.batch
        mine = sum(b.key_id == key.id for b in open_)
        if mine >= bcfg.max_open_batches_per_key or len(open_) >= bcfg.max_open_batches_per_owner:
            whose, most = ((f"key {key.id!r}", bcfg.max_open_batches_per_key)
                           if mine >= bcfg.max_open_batches_per_key
                           else ("this tenant", bcfg.max_open_batches_per_owner))
            raise errors.RateLimited(
                f"{whose} has {most} unfinished batches, the most allowed "
                "(gateway.batch.max_open_batches_per_*); wait for one to end or cancel one",
                code="too_many_open_batches")
        now = int(self.clock())
        b = Batch(id=new_id("batch"), endpoint=endpoint, input_file_id=file_id,
                  completion_window=window, created_at=now,
                  expires_at=now + COMPLETION_WINDOWS[window], owner=key.owner,
                  key_id=key.id, output_path=new_id("file"), error_path=new_id("file"),
                  metadata=metadata)
        await self.store.save(b)
        return b.public()

    async def _owned(self, key: KeyRecord, batch_id: str) -> Batch:
        b = await self.store.load(batch_id)
        if b is None or b.owner != key.owner:
            raise errors.NotFound(f"No such Batch object: {batch_id[:80]}", param="batch_id")
        return b

    async def get_batch(self, key: KeyRecord, batch_id: str) -> dict[str, Any]:
        b = await self._owned(key, batch_id)
        return b.public(not b.done and await self.store.cancel_requested(b.id))

    async def cancel_batch(self, key: KeyRecord, batch_id: str) -> dict[str, Any]:
        b = await self._owned(key, batch_id)
        if b.done or b.status == "finalizing":
            raise errors.InvalidRequest(f"Cannot cancel a batch with status {b.status!r}.",
                                        param="batch_id", code="invalid_state")
        await self.store.request_cancel(b.id)
        return b.public(cancel_requested=True)

    async def list_batches(self, key: KeyRecord, after: str | None, limit: int) -> dict[str, Any]:
        batches = await self.store.owned(key.owner)
        views = [b.public(not b.done and await self.store.cancel_requested(b.id))
                 for b in _page(batches, after, limit + 1)]
        return _list(views, limit)


def _page(items: Sequence[Any], after: str | None, n: int) -> Sequence[Any]:
    """``n`` items after the one whose id is ``after`` (all from the start without it)."""
    start = 0
    if after is not None:
        ids = [getattr(i, "id", None) or i["id"] for i in items]
        start = ids.index(after) + 1 if after in ids else len(items)
    return items[start:start + n]


def _list(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}


async def _form(request: Request, limit: int) -> tuple[bytes, str, str]:
    """The multipart upload's ``file`` (its bytes and name) and ``purpose``; 413 past ``limit``
    bytes (counted as they arrive, so a chunked upload is stopped too), 400 when a part is
    missing."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "multipart/form-data":
        raise errors.UnsupportedMediaType(
            f"Content-Type must be multipart/form-data, not {ctype[:64] or 'missing'!r}")
    too_large = errors.PayloadTooLarge(f"file is over the limit of {limit} bytes")
    bound = limit + 64 * 1024  # the form's own fields and boundaries are small
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > bound:
        raise too_large
    seen = 0

    async def receive() -> Message:
        nonlocal seen
        msg = await request.receive()
        seen += len(msg.get("body", b""))
        if seen > bound:
            raise too_large
        return msg

    try:
        form = await Request(request.scope, receive).form(max_files=1, max_fields=8)
    except errors.ServeAppError:
        raise
    except Exception:  # starlette's MultiPartException, a broken boundary
        raise errors.InvalidRequest("the body is not a valid multipart form") from None
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise errors.InvalidRequest("the form has no 'file' part", param="file")
        if not isinstance(purpose, str) or purpose != "batch":
            raise errors.InvalidRequest(
                f"purpose must be 'batch', not {str(purpose)[:40]!r}: this gateway keeps files "
                "for the Batch API only", param="purpose")
        data = await upload.read()
        return data, (upload.filename or "upload.jsonl")[:256], purpose
    finally:
        await form.close()


async def _json(request: Request, limit: int) -> dict[str, Any]:
    require_json(request)
    return parse_body(await read_capped(request, limit))


def batch_router(authenticate: Authenticate) -> APIRouter:
    """The routes, with the gateway's own ``authenticate`` dependency (``gateway.api``)."""
    r = APIRouter()

    def svc(request: Request) -> BatchService:
        service = request.app.state.deps.batch
        assert isinstance(service, BatchService)
        return service

    @r.post("/v1/files")
    async def upload_file(request: Request,
                          key: KeyRecord = Depends(authenticate)) -> dict[str, Any]:
        s = svc(request)
        limit = s.cfg.gateway.batch.max_file_bytes
        data, name, purpose = await _form(request, limit)
        if len(data) > limit:
            raise errors.PayloadTooLarge(f"file is over the limit of {limit} bytes")
        if not data.strip():
            raise errors.InvalidRequest("the file is empty", param="file")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise errors.InvalidRequest("the file must be UTF-8 JSON lines", param="file") from None
        most = s.cfg.gateway.batch.max_files_per_owner
        if len(await asyncio.to_thread(s.files.list, key.owner)) >= most:
            raise errors.RateLimited(
                f"this tenant keeps {most} files, the most allowed "
                "(gateway.batch.max_files_per_owner); delete some first", code="too_many_files")
        return await asyncio.to_thread(s.files.create, key.owner, name, purpose, data)

    @r.get("/v1/files")
    async def list_files(
        request: Request, purpose: str | None = Query(None, max_length=64),
        limit: int = Query(10000, ge=1, le=10000), after: str | None = Query(None, max_length=80),
        order: str = Query("desc", pattern="^(asc|desc)$"),
        key: KeyRecord = Depends(authenticate),
    ) -> dict[str, Any]:
        if purpose is not None and purpose not in PURPOSES:
            raise errors.InvalidRequest(f"purpose must be one of {list(PURPOSES)}",
                                        param="purpose")
        found = await asyncio.to_thread(svc(request).files.list, key.owner, purpose)
        if order == "asc":
            found.reverse()
        return _list(list(_page(found, after, limit + 1)), limit)

    @r.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str,
                       key: KeyRecord = Depends(authenticate)) -> dict[str, Any]:
        return await asyncio.to_thread(svc(request).files.get, key.owner, file_id)

    @r.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str,
                           key: KeyRecord = Depends(authenticate)) -> FileResponse:
        path = await asyncio.to_thread(svc(request).files.content_path, key.owner, file_id)
        return FileResponse(path, media_type="application/octet-stream")

    @r.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str,
                          key: KeyRecord = Depends(authenticate)) -> dict[str, Any]:
        """Delete one of the owner's files; refused (409) while an unfinished batch reads it."""
        s = svc(request)
        await asyncio.to_thread(s.files.get, key.owner, file_id)  # 404 before anything else
        for b in await s.store.owned(key.owner):
            if b.input_file_id == file_id and not b.done:
                raise errors.Conflict(f"file {file_id} is the input of batch {b.id}, which is "
                                      f"{b.status}; cancel it or let it finish first")
        return await asyncio.to_thread(s.files.delete, key.owner, file_id)

    @r.post("/v1/batches")
    async def create_batch(request: Request,
                           key: KeyRecord = Depends(authenticate)) -> dict[str, Any]:
        s = svc(request)
        return await s.create_batch(key, await _json(request, s.cfg.gateway.http.max_body_bytes))

    @r.get("/v1/batches")
    async def list_batches(
        request: Request, after: str | None = Query(None, max_length=80),
        limit: int = Query(20, ge=1, le=100), key: KeyRecord = Depends(authenticate),
    ) -> dict[str, Any]:
        return await svc(request).list_batches(key, after, limit)

    @r.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str,
                        key: KeyRecord = Depends(authenticate)) -> dict[str, Any]:
        return await svc(request).get_batch(key, batch_id)

    @r.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str,
                           key: KeyRecord = Depends(authenticate)) -> dict[str, Any]:
        return await svc(request).cancel_batch(key, batch_id)

    return r
