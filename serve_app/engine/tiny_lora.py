"""Build the tiny LoRA adapter that the embedded default ships for ``tiny-chat``.

Like the model itself (``tiny_model.py``), the adapter is seeded random numbers written in PEFT's
format (``adapter_config.json`` + ``adapter_model.safetensors``), so the build is deterministic,
needs no download and takes well under a second. Its scale is large on purpose: greedy output
with the adapter differs from the base model's within a few tokens, so a client can see that the
adapter was applied.

``seed`` makes other adapters of the same recipe: ``make bench-lora`` builds 16 distinct ones
(seeds ``SEED + 1`` ...) for ``tiny-chat`` in a temporary folder. The builtin is ``SEED``'s.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from serve_app.engine import tiny_model

# Bump when the recipe changes, so an old cached build is not reused.
RECIPE_VERSION = "1"
MARKER = "tiny-lora.json"
SEED = 4321
RANK = 8
ALPHA = 32  # scale alpha / rank = 4: a delta several times the base weights' (std 0.02)
INIT_STD = 0.1
# Modules that vLLM does not pack (qkv and gate_up are packed): one LoRA pair each, per layer.
TARGETS = {
    # module: (in_features, out_features)
    "o_proj": (tiny_model.HIDDEN, tiny_model.HIDDEN),
    "down_proj": (tiny_model.INTERMEDIATE, tiny_model.HIDDEN),
}
_PARENT = {"o_proj": "self_attn", "down_proj": "mlp"}


def is_built(path: Path, seed: int = SEED) -> bool:
    try:
        info = json.loads((path / MARKER).read_text())
        return bool(info.get("recipe") == RECIPE_VERSION and info.get("seed") == seed)
    except (OSError, ValueError, AttributeError):
        return False


def adapter_config() -> dict[str, object]:
    """PEFT's ``adapter_config.json`` for the adapter (what vLLM's ``PEFTHelper`` reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny-chat",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": sorted(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def build_tiny_lora(path: Path, *, force: bool = False, seed: int = SEED) -> Path:
    """Write the adapter made from ``seed`` into ``path`` unless a build of the same recipe and
    seed is already there.

    Written to a temporary sibling that is renamed into place, as the model is, so two replicas
    building at once never leave a half-written adapter behind."""
    path = path.expanduser().resolve()
    if is_built(path, seed) and not force:
        return path

    import torch
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-lora-", dir=path.parent))
    try:
        gen = torch.Generator().manual_seed(seed)
        tensors: dict[str, torch.Tensor] = {}
        for layer in range(tiny_model.LAYERS):
            for module, (fan_in, fan_out) in sorted(TARGETS.items()):
                prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * INIT_STD
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * INIT_STD
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config(), indent=2))
        (tmp / MARKER).write_text(json.dumps({"recipe": RECIPE_VERSION, "seed": seed}))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_built(path, seed):  # another process finished the same build first
            return path
        raise
    return path
