"""The Responses API's routes: ``POST /v1/responses`` (stored by default, chained by
``previous_response_id``, or run in the ``background``), and ``GET``/``DELETE
/v1/responses/{id}``, ``/input_items`` and ``/cancel`` on the stored ones
(``gateway/responses``). The key is checked before anything is read; another tenant's id is 404."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response

from serve_app.config import KeyRecord
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.accounting.tracecontext import TraceContext
from serve_app.gateway.http.answers import to_response
from serve_app.gateway.responses.chain import listed_items
from serve_app.protocol import Endpoint

Dependency = Callable[..., Awaitable[Any]]


def responses_router(endpoint: Endpoint, authenticate: Dependency, get_deps: Dependency,
                     read_json: Callable[[Request, Any], Awaitable[tuple[dict[str, Any], int]]],
                     ) -> APIRouter:
    """The routes, over the app's own key check, collaborators and body reader (``api``)."""
    router = APIRouter()

    @router.post(endpoint.path)
    async def create(request: Request, key: KeyRecord = Depends(authenticate),
                     d: Any = Depends(get_deps)) -> Response:
        clock = StageClock.for_request(request.scope, trust_stamp=d.trust_arrival_stamp)
        body, size = await read_json(request, d)
        turn = await d.responses.prepare(key, endpoint, body, request.headers)
        clock.mark("parse_auth")
        trace = TraceContext.from_headers(request.headers)
        answer = await d.pipeline.handle(key, endpoint, turn.body, size, clock, trace,
                                         request.headers, affinity=turn.affinity)
        if turn.background:
            answer = await d.responses.start_background(key, turn, answer)
        else:
            answer = await d.responses.keep(key, turn, answer)
        return to_response(answer)

    @router.get(endpoint.path + "/{response_id}", response_model=None)
    async def retrieve(
        response_id: str, stream: bool = Query(False),
        starting_after: int | None = Query(None, ge=0),
        key: KeyRecord = Depends(authenticate), d: Any = Depends(get_deps),
    ) -> Response | dict[str, Any]:
        if stream:
            return to_response(await d.responses.stream(key, response_id, starting_after))
        doc = await d.responses.get(key, response_id)
        return doc["response"]  # type: ignore[no-any-return]

    @router.delete(endpoint.path + "/{response_id}")
    async def delete(response_id: str, key: KeyRecord = Depends(authenticate),
                     d: Any = Depends(get_deps)) -> dict[str, Any]:
        await d.responses.delete(key, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.post(endpoint.path + "/{response_id}/cancel")
    async def cancel(response_id: str, key: KeyRecord = Depends(authenticate),
                     d: Any = Depends(get_deps)) -> dict[str, Any]:
        doc = await d.responses.cancel(key, response_id)
        return doc["response"]  # type: ignore[no-any-return]

    @router.get(endpoint.path + "/{response_id}/input_items")
    async def input_items(
        response_id: str, limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = Query("desc"), after: str | None = Query(None),
        key: KeyRecord = Depends(authenticate), d: Any = Depends(get_deps),
    ) -> dict[str, Any]:
        doc = await d.responses.get(key, response_id)
        return listed_items(doc, limit, order, after)

    return router
