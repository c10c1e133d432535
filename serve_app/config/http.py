"""The gateway's HTTP side (``gateway.http``): body size, timeouts, and how it answers 503s."""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt

from serve_app.config.base import _Strict

MAX_BODY_LIMIT = 32 * 1024 * 1024  # half the replica gRPC message limit (serve_app/local/front_door.py)


class HttpConfig(_Strict):
    """How a request is read, how long it may run, and the 503s the gateway answers itself
    (``serve_app/gateway/http``, the forwarder and the drain)."""

    max_body_bytes: PositiveInt = Field(
        default=4 * 1024 * 1024,
        le=MAX_BODY_LIMIT,
        description="Largest request body. A body crosses to the model replica as one gRPC message "
        "(Ray Serve's throughput mode), whose limit serve-app sets to 64 MiB: so at most 32 MiB.",
    )
    request_timeout_s: PositiveFloat = 600.0
    stream_idle_timeout_s: PositiveFloat = Field(
        default=120.0,
        description="Longest silence allowed between two chunks of a stream before it is ended "
        "with an error.",
    )
    retry_after_s: PositiveInt = Field(
        default=2, description="The Retry-After of every 503 the gateway answers itself; an overload's "
        "(capacity, shedding, a queue wait) is jittered from it to twice it."
    )
    unavailable_hold_s: PositiveFloat = Field(
        default=5.0,
        description="Longest a request waits for its first answer from a model that lost its "
        "healthy replicas (all dead or restarting) before it is answered 503 with Retry-After.",
    )
    drain_timeout_s: PositiveFloat = Field(
        default=10.0,
        description="On a graceful stop (Ctrl-C, serve shutdown), how long in-flight streams may "
        "run on before they are ended with an error event.",
    )
