"""serve_app.gateway.http.models: a card's output bound is the key's cap within the context."""

from __future__ import annotations

import pytest

from serve_app.gateway.admission.tiers import TierPolicy
from serve_app.gateway.http.models import ModelCards
from serve_app.gateway.routing.router import Router
from tests.unit.builders import app_config, key_record, model, tier


@pytest.mark.parametrize(("context", "tier_cap", "key_cap", "output"), [
    (4096, 1024, None, 1024),   # the tier's cap, within the context
    (4096, 1024, 256, 256),     # the key's own cap overrides its tier's
    (512, 1024, None, 512),     # a cap past the context: the context bounds it
    (None, 1024, None, 1024),   # the context unknown at the gateway (only the engine knows it)
    (None, None, None, None),   # neither known: the card says so instead of guessing
])
def test_max_output_tokens_is_the_keys_cap_within_the_context(
        context: int | None, tier_cap: int | None, key_cap: int | None, output: int | None) -> None:
    cfg = app_config(model("m", engine={"max_model_len": context}),
                     tiers={"standard": tier(limits={"max_tokens_cap": tier_cap})})
    key = key_record(limits={"max_tokens_cap": key_cap} if key_cap else None)
    card = ModelCards(cfg, TierPolicy(cfg), 0).card(Router(cfg).resolve("m", key), key)
    assert card["max_output_tokens"] == output
    assert card["limits"]["max_tokens_cap"] == (key_cap or tier_cap)
