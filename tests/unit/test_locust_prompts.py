"""The load tests' prompt set: reproducible from its seed, and ShareGPT files are accepted."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.prompts import CONTEXT_BUDGET, DEFAULT_PATH, generate, load_prompts, write_jsonl


def test_bundled_set_is_what_the_generator_makes_from_its_seed(tmp_path: Path) -> None:
    out = tmp_path / "prompts.jsonl"
    write_jsonl(generate(), out)
    assert out.read_bytes() == DEFAULT_PATH.read_bytes()
    prompts = load_prompts()
    assert len(prompts) == 200
    ins = sorted(len(p.text.split()) for p in prompts)
    outs = sorted(p.max_tokens for p in prompts)
    # Long right tails (log-normal), but everything fits the tiny model's 2048-token context.
    assert ins[-1] > 3 * ins[len(ins) // 2] and outs[-1] > 3 * outs[len(outs) // 2]
    assert all(len(p.text.split()) + p.max_tokens <= CONTEXT_BUDGET for p in prompts)
    assert generate(seed=1) != generate(seed=2)


def test_sharegpt_file_gives_first_human_turn_and_reply_length(tmp_path: Path) -> None:
    doc = [
        {"conversations": [{"from": "human", "value": "Tell me about tiers"},
                           {"from": "gpt", "value": " ".join(["word"] * 40)}]},
        {"conversations": [{"from": "gpt", "value": "no human turn first"},
                           {"from": "human", "value": "Second"}]},
        {"conversations": []},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(doc))
    prompts = load_prompts(path, max_output=32)
    assert [p.text for p in prompts] == ["Tell me about tiers", "Second"]
    assert prompts[0].max_tokens == 32  # the reply's 40 words, capped
    assert prompts[1].max_tokens > 0
