"""The limit charge of one request: every configured limit at once, and its settlement.

A request is charged against its key's and its tier's counters together (concurrency, RPM, and
TPM for the reserved tokens: the completion bound plus a prompt estimate), so that it is admitted
only if all of them have room. The verdict also gives the answer's limit headers (``headers``):
OpenAI's ``x-ratelimit-*`` on every route, and Anthropic's ``anthropic-ratelimit-*`` as well on the
Messages API routes. A refused request's answer carries them too, read by ``standing`` without a
charge. When the request ends, concurrency is released and the unused reservation refunded (or the
overrun charged) against the real usage.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime

from serve_app import errors
from serve_app.config import KeyRecord, Limits
from serve_app.gateway.admission.limits import Charge, LimitBackend, Verdict
from serve_app.protocol import Dialect

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Hold:
    """What an admitted request holds on the counters, and the headers its answer carries."""

    token_charges: list[Charge]
    gauges: list[Charge]
    headers: dict[str, str]


def _fmt_reset(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.3g}s" if s < 10 else f"{round(s)}s"
    return f"{int(s // 60)}m{round(s % 60)}s"


def _charges(key: KeyRecord, key_limits: Limits, tier_limits: Limits,
             tokens: int) -> tuple[list[Charge], list[int], list[int]]:
    """The charges, and the indexes of the RPM and TPM ones (the key's first)."""
    charges: list[Charge] = []
    rpm_idx: list[int] = []
    tpm_idx: list[int] = []
    for scope, lim in ((f"key:{key.id}", key_limits), (f"tier:{key.tier}", tier_limits)):
        if lim.max_concurrent:
            charges.append(Charge(f"{scope}:conc", 1, lim.max_concurrent, gauge=True))
        if lim.rpm:
            rpm_idx.append(len(charges))
            charges.append(Charge(f"{scope}:rpm", 1, lim.rpm))
        if lim.tpm:
            tpm_idx.append(len(charges))
            charges.append(Charge(f"{scope}:tpm", tokens, lim.tpm))
    return charges, rpm_idx, tpm_idx


@dataclass(frozen=True)
class Window:
    """One per-minute limit as an answer reports it: its size, the units left, and the seconds
    until it is full again (the GCRA bucket refills continuously, so "reset" means full)."""

    kind: str  # "requests" or "tokens", as both header families name it
    limit: int
    remaining: int
    reset_s: float


def _windows(charges: list[Charge], v: Verdict, rpm: list[int], tpm: list[int]) -> list[Window]:
    """The RPM and TPM windows the answer reports: the key's own limits when set (else the
    tier's), as ``v`` (a verdict with every charge read) saw them."""
    return [Window(kind, charges[idx[0]].limit, int(v.remaining[idx[0]]), v.reset_s[idx[0]])
            for kind, idx in (("requests", rpm), ("tokens", tpm)) if idx]


def _rfc3339(t: float) -> str:
    """Anthropic's reset format, rounded up to the second: a client that waits until then finds
    the window full, never a moment short of it."""
    return datetime.fromtimestamp(math.ceil(t), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def headers(windows: list[Window], dialect: Dialect, now: float) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers on every route; on Anthropic's, also its
    ``anthropic-ratelimit-*`` (which Claude Code and the anthropic SDK read), from the same
    windows, the reset as a time instead of a duration."""
    h: dict[str, str] = {}
    for w in windows:
        h[f"x-ratelimit-limit-{w.kind}"] = str(w.limit)
        h[f"x-ratelimit-remaining-{w.kind}"] = str(w.remaining)
        h[f"x-ratelimit-reset-{w.kind}"] = _fmt_reset(w.reset_s)
        if dialect == "anthropic":
            h[f"anthropic-ratelimit-{w.kind}-limit"] = str(w.limit)
            h[f"anthropic-ratelimit-{w.kind}-remaining"] = str(w.remaining)
            h[f"anthropic-ratelimit-{w.kind}-reset"] = _rfc3339(now + w.reset_s)
    return h


async def standing(backend: LimitBackend, key: KeyRecord, key_limits: Limits, tier_limits: Limits,
                   dialect: Dialect, now: float) -> dict[str, str]:
    """The limit headers of a refused request: the key's counters as they stand, read without a
    charge (a refused charge stops at the first full counter, and a refusal after the charge has
    given it back). Empty when the counters cannot be read, as for an admitted request."""
    charges, rpm, tpm = _charges(key, key_limits, tier_limits, 0)
    try:
        verdict = await backend.peek(charges, now)
    except Exception as exc:
        logger.warning("limit headers left out, counter backend failed: %s",
                       exc.__class__.__name__)
        return {}
    return headers(_windows(charges, verdict, rpm, tpm), dialect, now)


async def charge(backend: LimitBackend, key: KeyRecord, key_limits: Limits, tier_limits: Limits,
                 reserve: int, field: str | None, now: float, dialect: Dialect = "openai") -> Hold:
    """Charge every limit for ``reserve`` tokens, or raise: ``RateLimited`` (429 with when to
    retry; ``ConcurrencyLimited`` for a concurrency cap; the caller adds the limit headers,
    ``standing``), or ``InvalidRequest`` naming ``field`` when the reservation alone is over a TPM
    limit (it could never be admitted). The hold's headers are ``dialect``'s (``headers``)."""
    charges, rpm, tpm = _charges(key, key_limits, tier_limits, reserve)
    try:
        verdict = await backend.admit(charges, now)
    except Exception as exc:
        # The shared counters are unreachable: serve unlimited rather than fail the request.
        # Availability beats strictness here; the log and the missing headers show it.
        logger.error("limits not enforced, counter backend failed: %s", exc.__class__.__name__)
        verdict = Verdict(allowed=True)
        charges, rpm, tpm = [], [], []
    if not verdict.allowed:
        failed = charges[verdict.failed]
        wait = max(verdict.retry_after_s, 0.001)
        if failed.counter.endswith(":tpm") and reserve > failed.limit:
            raise errors.InvalidRequest(
                f"this request may use {reserve} tokens, more than the {failed.limit} tokens per "
                f"minute allowed{f'; lower {field}' if field else ''}",
                param=field,
            )
        what = {"conc": "concurrent requests", "rpm": "requests per minute",
                "tpm": "tokens per minute"}[failed.counter.rsplit(":", 1)[1]]
        on_key = failed.counter.startswith("key:")
        scope = f"key (tier {key.tier!r})" if on_key else f"tier {key.tier!r} (all its keys)"
        # A window's wait is exact (GCRA knows when the request fits); a concurrency cap's is
        # the backend's guess, since it frees when some request in flight ends.
        limited = errors.ConcurrencyLimited if failed.gauge else errors.RateLimited
        raise limited(
            f"Rate limit reached for {what} ({failed.limit}) on this {scope}. "
            f"Retry in {wait:.2f} s. For a higher limit, an admin can give this key its own "
            f"(serve-app keys create --max-concurrent/--rpm/--tpm, or PATCH /admin/v1/keys) or a "
            f"key in a tier with more (--tier).",
            headers={
                "Retry-After": str(max(1, math.ceil(wait))),
                "retry-after-ms": str(max(1, math.ceil(wait * 1000))),
            },
        )
    return Hold([charges[i] for i in tpm], [c for c in charges if c.gauge],
                headers(_windows(charges, verdict, rpm, tpm), dialect, now))


async def refund(backend: LimitBackend, gauges: list[Charge], token_charges: list[Charge],
                 reserved: int, used: int | None, now: float) -> None:
    """Release the ``gauges`` (concurrency) and refund the unused reservation of the
    ``token_charges`` (or charge the overrun); ``used`` None (unknown) keeps the reservation."""
    refunds = list(gauges)
    if used is not None:
        delta = reserved - used
        refunds += [Charge(c.counter, delta, c.limit) for c in token_charges if delta]
    try:
        await backend.refund(refunds, now)
    except Exception:  # a lost refund only makes limits stricter for a minute; never fail the request
        logger.warning("limit settlement failed", exc_info=True)
