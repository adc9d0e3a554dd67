"""HF architecture name -> model class, imported lazily."""

from __future__ import annotations

import importlib

# architecture -> (module, class)
_MODELS: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("deltaserve.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3_5ForCausalLM": ("deltaserve.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": (
        "deltaserve.models.qwen3_5",
        "Qwen3_5ForConditionalGeneration",
    ),
    "Qwen3_5MoeForCausalLM": ("deltaserve.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": (
        "deltaserve.models.qwen3_5_moe",
        "Qwen3_5MoeForConditionalGeneration",
    ),
    "Qwen3NextForCausalLM": ("deltaserve.models.qwen3_next", "Qwen3NextForCausalLM"),
    "DeepseekV2ForCausalLM": ("deltaserve.models.deepseek_v2", "DeepseekV2ForCausalLM"),
}

# model_type -> architecture, for config.json files that lack "architectures"
_MODEL_TYPES: dict[str, str] = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def architecture_for_model_type(model_type: str) -> str | None:
    return _MODEL_TYPES.get(model_type)


def get_model_class(architecture: str) -> type:
    """The model class for an HF architecture name; ValueError listing the supported ones."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            + ", ".join(supported_architectures())
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
