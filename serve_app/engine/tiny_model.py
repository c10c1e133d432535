"""Build the tiny Llama-architecture chat model that the embedded default serves.

The weights are seeded random numbers and the tokenizer is a byte-level BPE trained on a corpus
generated here, so the build is deterministic, needs no download and takes a few seconds on CPU.
The text it produces is gibberish, but every request runs through real vLLM inference.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Bump when the recipe changes, so an old cached build is not reused (the chat template is also
# checked by its digest, so a template edit alone rebuilds too).
RECIPE_VERSION = "2"
MARKER = "tiny-model.json"

# head_dim = hidden / heads = 64: the CPU attention kernel rejects 16 but accepts 64.
HIDDEN = 128
HEADS = 2
KV_HEADS = 1
LAYERS = 2
INTERMEDIATE = 256
VOCAB = 1024
# Agents' first requests are long (Claude Code's is about 36k tokens in this tokenizer, Codex's
# about 29k), so the context is 64k. Llama's positions are rotary: the weights do not depend on it.
MAX_POSITIONS = 65536
SEED = 1234

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# ChatML with tools rendered the Hermes way (as Qwen2.5 and NousResearch's Hermes models do), so
# vLLM's `hermes` tool parser matches it: the tool signatures go into the system turn inside
# <tools></tools>, an assistant's calls are <tool_call>{"name", "arguments"}</tool_call>, and tool
# results come back as <tool_response> in a user turn. The model is random, so it rarely emits a
# call itself; what this buys is that agents' tool requests (tool_choice "auto") are accepted.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content -%}"
    "{%- if part is mapping and part.get('text') -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set skip_first = tools and messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if skip_first -%}{{ text(messages[0]['content']) + '\n\n' }}{%- endif -%}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and '"
    " 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n'"
    " '{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and skip_first -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\n<tool_response>\n' + text(message['content']) + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{ '<|im_end|>\n' }}{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + text(message['content']) }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call.get('function') else call -%}"
    "{{ '\n<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}"
    "{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "{{ '}\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def template_digest() -> str:
    """A short digest of the chat template: a build with another template is rebuilt."""
    return hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()[:16]


_WORDS = (
    "the a an model engine token request stream batch queue latency throughput gateway key tier "
    "premium standard replica deploy serve cluster node memory cache prefix prompt answer question "
    "hello world user assistant system time fast slow small large open source vllm ray python test "
    "what is how why when where who which can will should would could please thanks yes no "
    "one two three four five six seven eight nine ten red green blue cat dog house tree river city"
).split()


def _corpus(lines: int = 4000) -> list[str]:
    rng = random.Random(SEED)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return out


def is_built(path: Path) -> bool:
    marker = path / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
        return bool(info.get("recipe") == RECIPE_VERSION and info.get("template") == template_digest())
    except (OSError, ValueError, AttributeError):
        return False


def build_tiny_model(path: Path, *, force: bool = False) -> Path:
    """Build the model into ``path`` unless a build of the same recipe is already there.

    The build goes to a temporary sibling directory that is renamed into place, so a crash
    (or two replicas building at once) never leaves a half-written model behind.
    """
    path = path.expanduser().resolve()
    if is_built(path) and not force:
        return path

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    logger.info("Building the tiny chat model into %s", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=path.parent))
    try:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(), trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="<|im_end|>",
            unk_token="<unk>",
            pad_token="</s>",
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(tmp)

        torch.manual_seed(SEED)
        config = LlamaConfig(
            vocab_size=tok.get_vocab_size(),
            hidden_size=HIDDEN,
            intermediate_size=INTERMEDIATE,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            max_position_embeddings=MAX_POSITIONS,
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            pad_token_id=fast.pad_token_id,
            tie_word_embeddings=False,
            torch_dtype="float32",
        )
        model = LlamaForCausalLM(config).to(torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / MARKER).write_text(json.dumps(
            {"recipe": RECIPE_VERSION, "seed": SEED, "template": template_digest()}
        ))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_built(path):  # another process finished the same build first
            return path
        raise
    return path
