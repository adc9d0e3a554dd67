"""Random-weight DFlash drafters in the shapes of released ones, for benchmarks on machines that
cannot download checkpoints: `speculative_config={"method": "dflash", "model":
"random:qwen3.5-9b-dflash", ...}` (or `drafter_preset_config(name)` in code).

Sources (public model cards and configs quoted in public repositories; what is not sourced is
said so):

- qwen3.5-9b-dflash (z-lab/Qwen3.5-9B-DFlash): 5 Qwen3 layers, hidden 4096, 32 heads (8 kv
  heads of 128, as every z-lab drafter config quoted: Qwen3-8B / LongCat / Qwen3.5-27B
  drafters), block_size 16, mask_token_id 248070, target_layer_ids [1, 8, 15, 22, 29],
  num_target_layers 32 (model card; a converter's metadata quotes the same dflash keys),
  vocab 248320 (the Qwen3.5 tokenizer). NOT sourced: intermediate_size 12288 (the target's
  FFN width, as z-lab's Qwen3-8B drafter uses its target's 12288), rope_theta 1e7 (the
  target's), rms_norm_eps 1e-6, all layers full attention (older z-lab drafters).
- tiny-dflash: NOT a released drafter. A 2-layer drafter (one causal sliding-window layer, one
  full) for the `tiny-qwen3.5` random target (hidden 64, vocab 512, 4 layers), for CPU tests.
"""

from __future__ import annotations

from typing import Any

RANDOM_PREFIX = "random:"

DRAFTER_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-9b-dflash": {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0},
        "attention_bias": False,
        "vocab_size": 248320,
        "num_target_layers": 32,
        "layer_types": ["full_attention"] * 5,
        "dflash_config": {
            "block_size": 16,
            "mask_token_id": 248070,
            "target_layer_ids": [1, 8, 15, 22, 29],
        },
    },
    "tiny-dflash": {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "vocab_size": 512,
        "num_target_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 32,
        "dflash_config": {"block_size": 8, "mask_token_id": 511, "target_layer_ids": [0, 2]},
    },
}


def random_preset_name(model: str) -> str | None:
    """`"random:NAME"` -> NAME (checked), any other string -> None (a checkpoint directory)."""
    if not model.startswith(RANDOM_PREFIX):
        return None
    name = model[len(RANDOM_PREFIX) :]
    if name not in DRAFTER_PRESETS:
        raise ValueError(
            f"unknown random drafter {name!r}; choose from: " + ", ".join(sorted(DRAFTER_PRESETS))
        )
    return name


def drafter_preset_config(name: str) -> dict[str, Any]:
    """The config.json (as a dict) of preset `name`."""
    if name not in DRAFTER_PRESETS:
        raise ValueError(
            f"unknown random drafter {name!r}; choose from: " + ", ".join(sorted(DRAFTER_PRESETS))
        )
    raw = DRAFTER_PRESETS[name]
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
