"""The operator's console at ``/console`` (``gateway.console``): its session secret and lifetime,
how much of the audit log it shows, and where Prometheus answers for the SLA page."""

from __future__ import annotations

from pydantic import Field, PositiveInt

from serve_app.config.base import _Strict


class ConsoleConfig(_Strict):
    """The console's sessions (``serve_app/gateway/http/console.py``)."""

    enabled: bool = Field(default=True, description="Serve the operator's console at /console.")
    secret: str | None = Field(
        default=None, min_length=32, repr=False,
        description="The key that signs console sessions and CSRF tokens (32+ characters), the "
        "same on every gateway replica. Null: one is made once and kept in the state layer "
        "(Redis key serve-app:secret:console with gateway.state.redis_url, else the 0600 file "
        "<gateway.state.dir>/console.secret); with neither, sessions live only as long as the "
        "replica, and several replicas refuse each other's sessions.",
    )
    session_ttl_s: PositiveInt = Field(
        default=8 * 3600, le=7 * 24 * 3600,
        description="A console session ends this long after sign-in (the admin key is also "
        "re-checked on every request: revoked, expired or rotated, the session ends at once).",
    )
    audit_lines: PositiveInt = Field(
        default=200, le=5000, description="How many of the audit log's last lines the console shows.",
    )
    prometheus_url: str | None = Field(
        default=None, pattern=r"^https?://",
        description="Prometheus' base URL (e.g. http://127.0.0.1:9090), for the console's SLA page: "
        "each tier's TTFT p95 over the last 5 minutes. Null: the page shows the objectives and "
        "the SLO misses the usage store counts, and says that the p95 needs Prometheus.",
    )
