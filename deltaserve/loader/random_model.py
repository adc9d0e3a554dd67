"""Random-weight models in the shapes of real checkpoints, for benchmarks on machines that cannot
download weights (`--random-model NAME`).

`random_model_config(name)` builds the transformers config object of a preset
(deltaserve.loader.random_presets, with the source of every figure), exactly as loading that
checkpoint's config.json would (text part only), and `init_random_weights(model, seed)` fills a
model built from it with deterministic random values of a scale that keeps activations finite in
bf16 however deep the model is. The text is noise; speed and memory are those of the real model.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import nn

from deltaserve.layers.weight_loading import process_weights_after_loading
from deltaserve.loader.random_presets import (
    ARCHITECTURES,
    DEEPSEEK_V2,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_5_VL,
    QWEN3_NEXT,
    RANDOM_MODELS,
    VISION_PRESETS,
)

__all__ = [
    "ARCHITECTURES",
    "RANDOM_MODELS",
    "VISION_PRESETS",
    "init_random_weights",
    "random_model_config",
]


def _vision_config(name: str) -> tuple[Any, Any, str]:
    from transformers import Qwen3_5Config

    text_name, vision, ids = VISION_PRESETS[name]
    text, _, _ = random_model_config(text_name)
    ids = ids or {}
    if ids:
        ids = dict(ids, vision_end_token_id=511)
    config = Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=dict(vision, out_hidden_size=text.hidden_size),
        tie_word_embeddings=text.tie_word_embeddings,
        **ids,
    )
    config.architectures = [QWEN3_5_VL]
    config.name_or_path = f"random:{name}"
    return config, config.get_text_config(), QWEN3_5_VL


def random_model_config(name: str) -> tuple[Any, Any, str]:
    """(hf_config, text_config, architecture) of preset `name`, as `load_hf_config` returns them
    for a checkpoint directory; the config is text-only, so hf_config is text_config (a vision
    preset's hf_config holds the text and the vision config).

    Raises ValueError for an unknown name, listing the known ones."""
    if name in VISION_PRESETS:
        return _vision_config(name)
    if name not in RANDOM_MODELS:
        known = sorted([*RANDOM_MODELS, *VISION_PRESETS])
        raise ValueError(f"unknown random model {name!r}; choose from: " + ", ".join(known))
    architecture = ARCHITECTURES[name]
    if architecture == QWEN3_5:
        from transformers import Qwen3_5TextConfig as config_cls
    elif architecture == QWEN3_5_MOE:
        from transformers import Qwen3_5MoeTextConfig as config_cls
    elif architecture == QWEN3_NEXT:
        from transformers import Qwen3NextConfig as config_cls
    elif architecture == DEEPSEEK_V2:
        from transformers import DeepseekV2Config as config_cls
    else:
        from transformers import Qwen3Config as config_cls
    kwargs = RANDOM_MODELS[name]
    config = config_cls(**{k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()})
    config.architectures = [architecture]
    config.name_or_path = f"random:{name}"
    return config, config, architecture


# ---- weights -------------------------------------------------------------------------------

NORM_STD = 0.02  # spread of norm weights around their neutral value (0 zero-centred, else 1)
DT_MIN, DT_MAX = 1e-3, 1e-1  # GDN time step range at init (log-uniform), as in Mamba / FLA
A_MIN, A_MAX = 1.0, 16.0  # GDN decay rate A: A_log = log(U(A_MIN, A_MAX))


def _generator(device: torch.device, seed: int, name: str) -> torch.Generator:
    """A generator on `device` seeded from the run seed and the parameter's name, so a parameter
    gets the same values whatever order the parameters are visited in."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return gen


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


@torch.no_grad()
def _fill(module: nn.Module, attr: str, p: torch.Tensor, gen: torch.Generator) -> None:
    """Fill one parameter in place (on its device, in its dtype)."""
    if attr == "A_log":  # decay rate A in [A_MIN, A_MAX]
        tmp = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        p.copy_(tmp.uniform_(A_MIN, A_MAX, generator=gen).log_())
    elif attr == "dt_bias":  # softplus(dt_bias) = dt, dt log-uniform in [DT_MIN, DT_MAX]
        tmp = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        dt = tmp.uniform_(math.log(DT_MIN), math.log(DT_MAX), generator=gen).exp_()
        p.copy_(dt + torch.log(-torch.expm1(-dt)))
    elif _is_norm(module) and attr == "weight":
        # zero-centred norms scale by (1 + w); plain ones by w
        centre = 0.0 if getattr(module, "zero_centered", False) else 1.0
        p.normal_(centre, NORM_STD, generator=gen)
    elif p.dim() >= 2:
        # linear / embedding / conv weights: std 1 / sqrt(fan_in) keeps each projection's output
        # at its input's scale (the embedding's rows at 1 / sqrt(hidden), so tied logits are O(1))
        # (stacked experts [E, out, in]: each expert's matrix has fan-in `in`)
        fan_in = p.shape[-1] if p.dim() == 3 else p[0].numel()
        p.normal_(0.0, fan_in**-0.5, generator=gen)
    else:  # biases and any other vector
        p.normal_(0.0, NORM_STD, generator=gen)


def init_random_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of `model` in place with deterministic random values.

    Values are generated on each parameter's own device (a generator per parameter, seeded from
    `seed` and its name), so a GPU model is filled on the GPU without host copies. Scales:
    matrices N(0, 1 / fan_in) (embedding: 1 / hidden), norm weights N(0 or 1, 0.02) (0 for the
    zero-centred ones), GDN A_log = log U(1, 16), dt_bias = softplus^-1(dt) with dt log-uniform
    in [1e-3, 1e-1], biases N(0, 0.02). Then, as after loading a checkpoint, every module's
    `process_weights_after_loading` hook runs.
    """
    for mod_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if param.device.type == "meta":
                raise ValueError("init_random_weights needs materialised parameters, not meta")
            name = f"{mod_name}.{attr}" if mod_name else attr
            _fill(module, attr, param.data, _generator(param.device, seed, name))
    process_weights_after_loading(model)
