"""Admission reserves at most what a model can produce: agents send max_tokens of 32k-64k, and the
engine never generates more than the context left after the prompt, so the TPM reservation is
clamped to that (one Claude Code turn must not take a minute's token budget)."""

from __future__ import annotations

import asyncio

from serve_app.config import AppConfig, KeyRecord
from serve_app.gateway.admission.admission import Admission
from serve_app.gateway.admission.tiers import DEFAULT_RESERVE_TOKENS
from serve_app.state.limits import MemoryBackend

KEY = KeyRecord(id="agent", digest="sha256:" + "0" * 64, tier="standard")


def _admission(max_model_len: int | None, tpm: int = 200_000) -> Admission:
    engine = {"max_model_len": max_model_len} if max_model_len else {}
    cfg = AppConfig.model_validate({
        "tiers": {"standard": {"priority": 0, "key_limits": {"tpm": tpm}}},
        "default_tier": "standard",
        "models": [{"id": "m", "source": "builtin:tiny-chat", "engine": engine}],
    })
    return Admission(cfg, MemoryBackend())


def test_reservation_is_clamped_to_the_context_left() -> None:
    adm = _admission(max_model_len=8192)
    # A 20,000-byte body is estimated at 5,000 prompt tokens: at most 3,192 can follow.
    ticket = asyncio.run(adm.admit(KEY, ["m"], {"max_tokens": 64000}, 20_000))
    assert ticket.completion_tokens == 8192 - 5000
    assert ticket.reserved_tokens == 8192


def test_responses_max_output_tokens_is_clamped_too() -> None:
    adm = _admission(max_model_len=8192)
    ticket = asyncio.run(adm.admit(KEY, ["m"], {"max_output_tokens": 32000}, 4_000))
    assert ticket.completion_tokens == 8192 - 1000


def test_small_requests_are_unchanged() -> None:
    adm = _admission(max_model_len=8192)
    assert asyncio.run(adm.admit(KEY, ["m"], {"max_tokens": 16}, 400)).completion_tokens == 16
    assert asyncio.run(adm.admit(KEY, ["m"], {}, 400)).completion_tokens == DEFAULT_RESERVE_TOKENS


def test_prompt_over_the_context_still_reserves_one() -> None:
    adm = _admission(max_model_len=1024)
    ticket = asyncio.run(adm.admit(KEY, ["m"], {"max_tokens": 5000}, 8_000))
    assert ticket.completion_tokens == 1  # the engine will refuse it; the estimate stays bounded


def test_unknown_context_is_not_clamped() -> None:
    adm = _admission(max_model_len=None)
    assert asyncio.run(adm.admit(KEY, ["m"], {"max_tokens": 64000}, 400)).completion_tokens == 64000


def test_an_agent_turn_fits_a_minute_budget() -> None:
    """Before the clamp, a 64k max_tokens turn reserved 64k + prompt of a 100k TPM budget, so the
    second turn inside a minute was refused; now each turn reserves at most the context."""
    adm = _admission(max_model_len=32768, tpm=100_000)

    async def turns() -> None:
        for _ in range(2):
            await adm.admit(KEY, ["m"], {"max_tokens": 64000}, 40_000)

    asyncio.run(turns())
