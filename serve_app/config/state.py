"""Where the gateway's shared and durable state lives (``gateway.state``): what ``open_state``
opens (``serve_app/state``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from serve_app.config.base import _Strict


class StateConfig(_Strict):
    """The Redis that several gateway replicas share, the host's state folder, and where the
    rate-limit counters live."""

    redis_url: str | None = Field(
        default=None,
        description="Shared limit counters for several gateway replicas, e.g. "
        "redis://127.0.0.1:6379/0.",
    )
    dir: str | None = Field(
        default=None,
        description="Where this host keeps durable state without Redis: keys.sqlite "
        "(gateway.keys.store sqlite), usage.sqlite (usage and budgets) and audit.log. "
        "`serve-app run` sets it.",
    )
    limits_store: Literal["auto", "memory", "redis"] = Field(
        default="auto",
        description="Where the RPM/TPM/concurrency counters live. auto: in the gateway's memory "
        "when it runs one replica (exact, and no round trip before each request: on a busy 2-core "
        "host a Redis call cost p50 7-12 ms, p95 150-260 ms), in Redis (redis_url) when it runs "
        "several; memory: each replica counts alone; redis: always shared (needs redis_url).",
    )
