"""Build the tiny Llama-architecture chat model that the embedded default serves.

The weights are seeded random numbers and the tokenizer is a byte-level BPE trained on a corpus
generated here, so the build is deterministic, needs no download and takes a few seconds on CPU.
The text it produces is gibberish, but every request runs through real vLLM inference.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Bump when the recipe changes, so an old cached build is not reused.
RECIPE_VERSION = "1"
MARKER = "tiny-model.json"

# head_dim = hidden / heads = 64: the CPU attention kernel rejects 16 but accepts 64.
HIDDEN = 128
HEADS = 2
KV_HEADS = 1
LAYERS = 2
INTERMEDIATE = 256
VOCAB = 1024
MAX_POSITIONS = 2048
SEED = 1234

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

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
        return bool(json.loads(marker.read_text()).get("recipe") == RECIPE_VERSION)
    except (OSError, ValueError):
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
        (tmp / MARKER).write_text(json.dumps({"recipe": RECIPE_VERSION, "seed": SEED}))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_built(path):  # another process finished the same build first
            return path
        raise
    return path
