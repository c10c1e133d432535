"""What the gateway counts and records (``gateway.accounting``): traces, the audit log's size,
and the tenants' token budgets."""

from __future__ import annotations

from pydantic import Field, PositiveInt

from serve_app.config.base import _Strict
from serve_app.config.keys import Budget


class AccountingConfig(_Strict):
    """Usage, budgets, audit and traces (``serve_app/gateway/accounting``; the budgets are held
    and charged by admission, against the totals accounting keeps)."""

    otlp_endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP traces endpoint (e.g. http://127.0.0.1:4318/v1/traces): each request's "
        "stages are exported as OpenTelemetry spans. Off when null.",
    )
    audit_max_bytes: PositiveInt = Field(
        default=8 * 1024 * 1024,
        description="The audit log is rotated to audit.log.1 above this size (two files at most).",
    )
    tenant_budgets: dict[str, Budget] = Field(
        default_factory=dict,
        description="Token budgets per tenant (the keys' tenant field), shared by its keys.",
    )
