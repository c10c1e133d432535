"""The SLA tiers (``tiers``): a scheduling priority, objectives, limits and when to shed each."""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt

from serve_app.config.base import _Strict


class Limits(_Strict):
    """Per-key (or per-tier) limits. None means unlimited."""

    rpm: PositiveInt | None = Field(default=None, description="Requests per minute.")
    tpm: PositiveInt | None = Field(
        default=None, description="Prompt + completion tokens per minute."
    )
    max_concurrent: PositiveInt | None = Field(
        default=None, description="Requests in flight at once."
    )
    max_tokens_cap: PositiveInt | None = Field(
        default=None, description="A request's max_tokens is clamped to this."
    )

    def merged(self, override: Limits | None) -> Limits:
        if override is None:
            return self
        return self.model_copy(update=override.model_dump(exclude_unset=True))


class Objectives(_Strict):
    """The tier's service-level objectives, checked by load tests and dashboards."""

    ttft_p95_ms: PositiveFloat = 2000.0
    tpot_p95_ms: PositiveFloat = 200.0

QUEUE_WAIT_OBJECTIVES = 3  # a tier's default max_queue_wait_s, in TTFT objectives


class TierConfig(_Strict):
    """An SLA tier: a vLLM scheduling priority, objectives, limits and when to shed it.

    ``priority`` becomes vLLM's request priority (lower runs first) on engines that use
    ``scheduling_policy: priority``. ``shed_at`` is the fraction of a model's
    ``admission.saturation_requests`` above which the gateway rejects this tier with 503: the tier
    with the lowest ``shed_at`` is shed first, and 1.0 means the tier is never shed early.
    """

    priority: int = 0
    description: str = ""
    objectives: Objectives = Field(default_factory=Objectives)
    limits: Limits = Field(default_factory=Limits)
    key_limits: Limits = Field(
        default_factory=Limits, description="The default limits of each key of the tier."
    )
    shed_at: float = Field(default=1.0, gt=0.0, le=1.0)
    max_queue_wait_s: PositiveFloat | None = Field(
        default=None,
        description="Longest a request of this tier waits in a model's gateway queue (flow.enabled) "
        "before it is answered 503 with Retry-After; None: 3 x the tier's TTFT objective.",
    )

    @property
    def queue_wait_s(self) -> float:
        """How long a request of this tier may wait in a gateway queue. The default is a few
        objectives: the objective bounds the p95, so a request that waited past it is in the
        tail, and answering it late serves its client better than a 503 that sends it to the
        back of the line (with a bound of one objective, 7-14 of ~1,300 premium requests got 503
        at 4x the base load in the flow bench while premium's p95 stayed at half the objective)."""
        if self.max_queue_wait_s is not None:
            return self.max_queue_wait_s
        return QUEUE_WAIT_OBJECTIVES * self.objectives.ttft_p95_ms / 1000
