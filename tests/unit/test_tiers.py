"""The tier's max-token cap goes to the field the endpoint reads (its row's max_tokens_fields):
a Responses body is capped in max_output_tokens, chat's newer name wins over its older one, and
an endpoint that generates no text gets no field written into its body."""

from __future__ import annotations

import asyncio

import pytest

from serve_app import errors
from serve_app.config import AppConfig
from serve_app.gateway.admission.admission import Admission
from serve_app.gateway.admission.tiers import DEFAULT_RESERVE_TOKENS, TierPolicy
from serve_app.protocol import ENDPOINTS
from serve_app.state.limits import MemoryBackend
from tests.unit.builders import app_config, key_record, tier

KEY = key_record(tier="capped")


def _cfg(tpm: int | None = None) -> AppConfig:
    limits = {"max_tokens_cap": 64, **({"tpm": tpm} if tpm else {})}
    return app_config(tiers={"capped": tier(0, key_limits=limits)}, default_tier="capped")


def _clamp(endpoint: str, body: dict) -> tuple[int, str | None, dict]:
    budget = TierPolicy(_cfg()).clamp_max_tokens(body, KEY, ENDPOINTS[endpoint].max_tokens_fields)
    return budget.tokens, budget.field, body


def test_the_cap_goes_to_the_field_the_endpoint_reads() -> None:
    assert _clamp("responses", {"max_output_tokens": 5000}) == (64, "max_output_tokens",
                                                                {"max_output_tokens": 64})
    # Chat's max_tokens is no bound on a Responses answer: the cap is written where it is read.
    assert _clamp("responses", {"max_tokens": 8}) == (64, "max_output_tokens",
                                                      {"max_tokens": 8, "max_output_tokens": 64})
    assert _clamp("chat", {"max_tokens": 8, "max_completion_tokens": 900})[2] == {
        "max_tokens": 8, "max_completion_tokens": 64}
    assert _clamp("completions", {}) == (64, "max_tokens", {"max_tokens": 64})
    assert _clamp("messages", {"max_tokens": 10}) == (10, "max_tokens", {"max_tokens": 10})
    assert _clamp("embeddings", {"input": "x"}) == (64, None, {"input": "x"})


def test_a_bad_bound_is_refused_naming_its_field() -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        _clamp("responses", {"max_output_tokens": 0})
    assert info.value.param == "max_output_tokens"


def test_no_cap_reserves_the_default() -> None:
    cfg = app_config()
    key = key_record(tier=cfg.default_tier)
    budget = TierPolicy(cfg).clamp_max_tokens({}, key, ENDPOINTS["chat"].max_tokens_fields)
    assert budget.tokens == DEFAULT_RESERVE_TOKENS


def test_a_reservation_over_the_tpm_limit_names_the_endpoints_field() -> None:
    adm = Admission(_cfg(tpm=50), MemoryBackend())
    with pytest.raises(errors.InvalidRequest) as info:
        asyncio.run(adm.admit(KEY, ["m"], {"max_output_tokens": 10}, 4_000, ENDPOINTS["responses"]))
    assert info.value.param == "max_output_tokens" and "lower max_output_tokens" in info.value.message
    assert adm.inflight["m"] == 0  # the slot taken is given back
