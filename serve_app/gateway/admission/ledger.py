"""The pass of one admitted request (``Admission.enter`` gives it), and its one exit.

However a request ends (a complete answer, an error before the first byte, an error mid-stream, a
client that went away, a fallback), its ``Pass`` exits once with an ``Outcome``: that settles the
admission ticket (concurrency released, the token reservation settled against the engine's real
count), settles the budget hold, and records usage and metrics: release, charge what ran, refund
what never ran, exactly once. The pass also owns the request's one fallback.

Who exits it: the pipeline when no answer came, the forwarder when it returns a complete answer,
and a stream's ``forward.Relay`` at the engine's trailer (before the answer's last events go out)
or, when none came, as the stream's answer is finished (however it ends).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serve_app import errors
from serve_app.config import KeyRecord, TierConfig
from serve_app.gateway.accounting.genai import GenAiCall
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.accounting.tracecontext import TraceContext
from serve_app.gateway.accounting.usage import Usage
from serve_app.gateway.admission.budgets import BudgetHold
from serve_app.protocol import Tokens, tokens_of

if TYPE_CHECKING:
    from serve_app.gateway.admission.admission import Admission, Ticket

logger = logging.getLogger("ray.serve")

NO_TOKENS: Tokens = tokens_of(0, 0)


@dataclass(frozen=True)
class Outcome:
    """How one request ended, as the gateway saw it."""

    status: int
    # The engine's own counts; None when they are unknown (no answer came back), in which case the
    # whole token reservation stays charged.
    tokens: Tokens | None = None
    ttft_s: float | None = None
    duration_s: float | None = None

    @property
    def used_tokens(self) -> int | None:
        if self.tokens is None:
            return None
        return self.tokens["prompt_tokens"] + self.tokens["completion_tokens"]


class Pass:
    """One admitted request: what it holds (its ticket, its budget hold), its model, its
    fallback, and its one exit."""

    def __init__(
        self,
        key: KeyRecord,
        tier: TierConfig,
        ticket: Ticket,
        admission: Admission,
        usage: Usage,
        fallback: str | None,
        clock: StageClock,
        trace: TraceContext,
    ) -> None:
        self.key = key
        self.clock = clock  # from the arrival at the front door; its stages go out at the close
        self.trace = trace
        self.tier = tier
        self.ticket = ticket
        self._admission = admission
        self._usage = usage
        # Admission may already have placed the request on its fallback (the primary was full).
        self._fallback = fallback if fallback != ticket.model_id else None
        self._books: asyncio.Task[None] | None = None  # the one write of the books (``exit``)
        self.adapter: str | None = None  # a LoRA adapter's name: its usage and metrics are its own
        self.budget: BudgetHold | None = None  # the budgets' reservation, settled with the ticket
        self.call: GenAiCall | None = None  # the model call's span attributes (a model endpoint)

    @property
    def headers(self) -> dict[str, str]:
        """What the answer tells of the limits and budgets that admitted it."""
        return self.ticket.headers

    @property
    def model_id(self) -> str:
        return self.ticket.model_id

    @property
    def accounted(self) -> str:
        """The model the books name: the adapter the request asked for, else the model that ran it."""
        return self.adapter or self.ticket.model_id

    def fall_back(self) -> bool:
        """Move the request to its fallback model, once, if that model has room."""
        target, self._fallback = self._fallback, None
        if target is None:
            return False
        try:
            self._admission.move(self.ticket, self.key, target)
        except errors.ServiceUnavailable:
            return False
        return True

    async def exit(self, out: Outcome) -> None:
        """Settle what the request holds and record the outcome. Only the first call counts. The
        books are written to the end even if the caller is cancelled meanwhile (a client that went
        away)."""
        if self._books is None:
            self._books = asyncio.ensure_future(self._write(out))
        else:
            logger.warning("request on %s exited twice; the second exit is ignored", self.model_id)
        await asyncio.shield(self._books)

    async def _write(self, out: Outcome) -> None:
        await self._admission.settle(self.ticket, out.used_tokens)
        if self.budget is not None:
            try:
                await self.budget.settle(out.used_tokens)
            except Exception:  # a lost settlement leaves the reservation charged; never fail here
                logger.warning("budget settlement failed", exc_info=True)
        if out.status == 503:
            await self._usage.rejected(self.key, self.accounted, "backpressure")
        else:
            await self._usage.finished(self.key, self.tier, self.accounted, out.status, out.tokens,
                                       out.ttft_s, out.duration_s)
        call = (self.call.attributes(self.accounted, out.status, out.tokens, out.ttft_s)
                if self.call is not None else None)
        self._usage.stages_finished(self.clock, self.trace, tier=self.key.tier, model=self.accounted,
                                    call=call, call_name=self.call.span_name() if self.call else "")
