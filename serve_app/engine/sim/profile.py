"""Step-time models: how long one engine step takes for the work the scheduler put in it.

One step runs every scheduled request's new tokens through the model at once (vLLM's continuous
batching), so its time is modelled from the step's totals, as aiconfigurator splits a step::

    step_s = overhead + max(floor, a * prefill_tokens + c * decode_seqs)     # non-attention ops
             + b * prefill_attention + d * decode_context                     # attention

The non-attention ops (GEMMs, norms, communication) run at the step's total tokens: below a few
hundred tokens they take ``floor``, the time to read the weights once (a small decode batch costs
about as much as one sequence), above it they grow with the tokens. ``prefill_tokens`` are the new
(uncached) prompt tokens computed in the step; ``prefill_attention`` is their attention work, each
token attending to its context (``n * (context + n / 2)`` token pairs for a chunk of ``n`` after
``context`` cached or earlier tokens), which is why a cached prefix still costs a little;
``decode_seqs`` is the decode batch and ``decode_context`` the tokens its attention reads (batch
x mean context).

Profiles come from ``profiles.json`` beside this module; each says where its numbers come from
(``source``) and whether they are fitted to measurements (``fitted``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

PROFILES_FILE = Path(__file__).with_name("profiles.json")


@dataclass(frozen=True)
class StepWork:
    """What one step computes, summed over the requests scheduled in it."""

    prefill_tokens: int = 0
    prefill_attention: float = 0.0  # token pairs
    decode_seqs: int = 0
    decode_context: int = 0  # tokens read by the decode batch's attention

    @property
    def tokens(self) -> int:
        """Tokens the step computes (what ``max_num_batched_tokens`` bounds)."""
        return self.prefill_tokens + self.decode_seqs


@dataclass(frozen=True)
class StepProfile:
    """Coefficients of the step-time model, in seconds (per token, per token pair, per sequence)."""

    name: str
    overhead_s: float
    prefill_token_s: float
    prefill_pair_s: float
    decode_seq_s: float
    decode_context_s: float
    floor_s: float = 0.0
    fitted: bool = False
    source: str = ""

    def step_s(self, work: StepWork) -> float:
        """The modelled time of one step; 0 for a step that computes nothing."""
        if not work.tokens:
            return 0.0
        linear = self.prefill_token_s * work.prefill_tokens + self.decode_seq_s * work.decode_seqs
        return (self.overhead_s + max(self.floor_s, linear)
                + self.prefill_pair_s * work.prefill_attention + self.decode_context_s * work.decode_context)


def prefill_pairs(new: int, context: int) -> float:
    """Attention work of ``new`` tokens computed after ``context`` tokens (token pairs)."""
    return new * (context + new / 2)


@cache
def _table() -> dict[str, dict[str, Any]]:
    doc: dict[str, dict[str, Any]] = json.loads(PROFILES_FILE.read_text())["profiles"]
    return doc


def profile_names() -> tuple[str, ...]:
    """The names a config's ``simulated.profile`` may take."""
    return tuple(sorted(_table()))


def load_profile(name: str) -> StepProfile:
    """The named profile of ``profiles.json``; KeyError names the known ones."""
    table = _table()
    if name not in table:
        raise KeyError(f"profile {name!r} is not one of {', '.join(profile_names())}")
    row = table[name]
    return StepProfile(name=name, **{k: row[k] for k in (
        "overhead_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s", "decode_context_s",
        "floor_s", "fitted", "source")})
