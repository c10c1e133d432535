"""The load tests' prompt set: a bundled, reproducible set, or a user-supplied ShareGPT file.

``python -m loadtests.prompts`` regenerates ``loadtests/data/prompts.jsonl`` from a seed. Input and
output lengths follow log-normal distributions (long right tails, as in real chat traffic: most
prompts are short, a few are long), capped so that a prompt plus its output fits the tiny model's
2048-token context. Words are drawn from a fixed vocabulary, so a word is roughly one token.

``load_prompts(path)`` reads either that JSONL file or a ShareGPT-format JSON file (a list of
``{"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}``): the first human turn is the
prompt, and the word count of the gpt turn that follows it sets the output length.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PATH = Path(__file__).resolve().parent / "data" / "prompts.jsonl"
DEFAULT_SEED = 20260
DEFAULT_COUNT = 200
# Medians and spreads (sigma of the underlying normal) of the log-normal length distributions.
INPUT_MEDIAN, INPUT_SIGMA, INPUT_MIN, INPUT_MAX = 60, 0.9, 4, 1200
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MIN, OUTPUT_MAX = 96, 0.8, 8, 512
CONTEXT_BUDGET = 2048 - 64  # room for the chat template's tokens

_WORDS = (
    "the a of to and in is it that for on with as was be by this are from or have an they which "
    "one you were all we can her has there been if more when will would who so no out up into "
    "time system data model request server latency token cache memory queue batch user service "
    "explain summarise compare describe write list translate why how what example code function "
    "python error network storage cluster engine throughput capacity schedule priority tier "
    "question answer story poem email report plan review test design table chart number value"
).split()
_OPENERS = (
    "Explain", "Summarise", "Write", "Describe", "Compare", "List", "Translate", "Review",
    "Plan", "Answer",
)


@dataclass(frozen=True)
class Prompt:
    """One request of the load: the user message and how many tokens to ask for."""

    text: str
    max_tokens: int


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))


def generate(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[Prompt]:
    """The same ``count`` prompts for the same ``seed``, on every machine and Python version."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        n_in = _lognormal_int(rng, INPUT_MEDIAN, INPUT_SIGMA, INPUT_MIN, INPUT_MAX)
        n_out = _lognormal_int(rng, OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MIN, OUTPUT_MAX)
        n_out = min(n_out, CONTEXT_BUDGET - n_in)
        words = [rng.choice(_OPENERS)] + [rng.choice(_WORDS) for _ in range(n_in - 1)]
        prompts.append(Prompt(text=" ".join(words) + ".", max_tokens=n_out))
    return prompts


def write_jsonl(prompts: list[Prompt], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p.text, "max_tokens": p.max_tokens}) + "\n")


def _from_sharegpt(doc: list[dict[str, Any]], max_output: int) -> list[Prompt]:
    prompts = []
    for item in doc:
        turns = item.get("conversations") or []
        for i, turn in enumerate(turns):
            if turn.get("from") != "human" or not str(turn.get("value", "")).strip():
                continue
            reply = turns[i + 1] if i + 1 < len(turns) else {}
            n_out = len(str(reply.get("value", "")).split()) if reply.get("from") == "gpt" else 0
            n_in = len(str(turn["value"]).split())
            if n_in > INPUT_MAX:  # would not fit the tiny model's context
                break
            n_out = max(OUTPUT_MIN, min(n_out or OUTPUT_MEDIAN, max_output, CONTEXT_BUDGET - n_in))
            prompts.append(Prompt(text=str(turn["value"]), max_tokens=n_out))
            break
    return prompts


def load_prompts(path: str | Path | None = None, max_output: int = OUTPUT_MAX) -> list[Prompt]:
    """Read the bundled JSONL set (default) or a ShareGPT JSON file; outputs capped at ``max_output``."""
    path = Path(path) if path else DEFAULT_PATH
    text = path.read_text()
    if text.lstrip().startswith("["):
        prompts = _from_sharegpt(json.loads(text), max_output)
    else:
        prompts = []
        for line in text.splitlines():
            if line.strip():
                row = json.loads(line)
                prompts.append(Prompt(text=row["prompt"], max_tokens=min(int(row["max_tokens"]), max_output)))
    if not prompts:
        raise ValueError(f"{path}: no usable prompts (expected prompts JSONL or ShareGPT JSON)")
    return prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Regenerate the bundled prompt set reproducibly.")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--count", type=int, default=DEFAULT_COUNT)
    p.add_argument("--out", type=Path, default=DEFAULT_PATH)
    ns = p.parse_args(argv)
    prompts = generate(ns.count, ns.seed)
    write_jsonl(prompts, ns.out)
    ins = sorted(len(x.text.split()) for x in prompts)
    outs = sorted(x.max_tokens for x in prompts)
    print(f"wrote {len(prompts)} prompts to {ns.out}: input words p50 {ins[len(ins) // 2]} "
          f"max {ins[-1]}; output tokens p50 {outs[len(outs) // 2]} max {outs[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
