"""An ``Answer`` as an HTTP response: the one place where a model's answer meets Starlette.

A complete answer is a JSON ``Response``. A stream is an ``AnswerStream``, which ends its request
exactly once however the response ends: Starlette calls ``__call__`` for every response it sends,
even when the client is gone before the body starts, and a ``finally`` inside the body iterator
would then never run (the generator never started). So ``__call__``'s own ``finally`` awaits the
answer's ``finish`` (which closes the events and exits the request's pass). It also tells the
answer when its first body bytes have been handed to the server for the client (``written``):
the request's time to first token ends there.
"""

from __future__ import annotations

from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from serve_app.protocol import Answer


class AnswerStream(StreamingResponse):
    """A streamed answer's SSE response; its request ends when the response does."""

    def __init__(self, answer: Answer) -> None:
        assert answer.events is not None
        super().__init__(answer.events, status_code=answer.status,
                         media_type="text/event-stream", headers=answer.headers)
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        written = self.answer.written
        if written is not None:
            inner = send

            async def send(message: Message) -> None:
                nonlocal written
                await inner(message)
                # The first body bytes are on the client's connection: its time to first token.
                if written is not None and message["type"] == "http.response.body" and message.get(
                        "body"):
                    done, written = written, None
                    done()

        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.answer.finish is not None:
                await self.answer.finish()


def to_response(answer: Answer) -> Response:
    """The HTTP response of ``answer``."""
    if answer.events is not None:
        return AnswerStream(answer)
    return Response(answer.body or b"", status_code=answer.status, media_type="application/json",
                    headers=answer.headers)
