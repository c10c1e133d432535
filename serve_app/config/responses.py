"""Stored Responses (``gateway.responses``): how long the gateway keeps them, and how it watches a
background response's run."""

from __future__ import annotations

from pydantic import Field, PositiveFloat, model_validator

from serve_app.config.base import _Strict


class ResponsesConfig(_Strict):
    """OpenAI's Responses API with ``store`` (its default): the gateway keeps each response and its
    input in the state layer (``gateway.state``), so ``previous_response_id``, ``GET``/``DELETE
    /v1/responses/{id}``, ``/input_items`` and ``background`` work across replicas and restarts."""

    ttl_s: PositiveFloat = Field(
        default=30 * 86400.0,
        description="A stored response (and a background response's events) is deleted this long "
        "after its last write (OpenAI keeps them 30 days).",
    )
    heartbeat_s: PositiveFloat = Field(
        default=2.0,
        description="A background response's run writes its state at least this often, and "
        "checks its key and any cancel request as often.",
    )
    stale_after_s: PositiveFloat = Field(
        default=30.0,
        description="A background response whose run has written nothing for this long (its "
        "gateway replica died) is failed, with a message saying so, when it is next read.",
    )

    @model_validator(mode="after")
    def _stale_after_heartbeat(self) -> ResponsesConfig:
        if self.stale_after_s <= 2 * self.heartbeat_s:
            raise ValueError(f"gateway.responses.stale_after_s ({self.stale_after_s}) must be more "
                             f"than twice heartbeat_s ({self.heartbeat_s})")
        return self
