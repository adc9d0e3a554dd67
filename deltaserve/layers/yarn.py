"""DeepSeek-style rotary embedding: interleaved pairs, optional YaRN scaling (MLA layers).

DeepSeek-V2 rotates the `qk_rope_head_dim` channels of q_pe and k_pe as pairs (2i, 2i + 1)
(a complex multiply, as HF's modeling_deepseek_v2 `apply_rotary_emb` does), not NeoX's halves.

YaRN (`rope_type: yarn`; HF's `_compute_yarn_parameters`): with base b, rotary dim d, factor f,
original context L0 and beta_fast / beta_slow,

    extra_i = b^(-2i/d),  inter_i = extra_i / f
    low, high = floor / ceil of d * ln(L0 / (beta * 2 pi)) / (2 ln b) for beta_fast / beta_slow,
                clamped to [0, d - 1] (no floor / ceil when `truncate` is false)
    ramp_i = clamp((i - low) / (high - low), 0, 1)
    inv_freq_i = inter_i * ramp_i + extra_i * (1 - ramp_i)

and cos / sin are multiplied by the attention factor mscale(f, mscale) / mscale(f,
mscale_all_dim) (mscale(s, m) = 0.1 m ln s + 1 for s > 1, else 1; mscale(f, 1) when either is
unset; `attention_factor` when the config gives it). The softmax scale of the layer is
(nope + rope)^-0.5 * mscale(f, mscale_all_dim)^2 (`softmax_scale`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deltaserve.forward_context import ForwardContext


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(scale) + 1 for scale > 1, else 1 (YaRN's attention temperature)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_max: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
) -> torch.Tensor:
    """YaRN's blended inverse frequencies [dim / 2] float32 (see the module docstring)."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    i = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((i - low) / (high - low)).clamp(0, 1)  # 0: keep the original frequency
    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    inter = extra / factor
    return inter * ramp + extra * (1 - ramp)


class InterleavedRotary:
    """Rotary over pairs (2i, 2i + 1) of `rotary_dim` channels, cos / sin scaled by
    `attention_factor` (YaRN's). Holds no parameters (models are built on the meta device)."""

    def __init__(
        self, rotary_dim: int, inv_freq: torch.Tensor, attention_factor: float = 1.0
    ) -> None:
        if rotary_dim % 2 or inv_freq.shape != (rotary_dim // 2,):
            raise ValueError(f"bad rotary_dim {rotary_dim} for {tuple(inv_freq.shape)} freqs")
        self.rotary_dim = rotary_dim
        self.attention_factor = attention_factor
        self._inv_freq = inv_freq.float().cpu()
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim / 2] float32 (times the attention factor)."""
        inv = self._by_device.get(positions.device)
        if inv is None:
            inv = self._by_device[positions.device] = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]  # [T, d / 2]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def memo_key(self) -> tuple:
        return ("interleaved_rotary", self.rotary_dim, self.attention_factor, id(self._inv_freq))


def interleaved_cos_sin(
    rotary: InterleavedRotary, positions: torch.Tensor, ctx: ForwardContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the step's positions, computed once per step (memoised in `ctx.memo`)."""
    key = rotary.memo_key()
    cached = ctx.memo.get(key)
    if cached is None:
        cached = ctx.memo[key] = rotary.cos_sin(positions)
    return cached


def deepseek_rope_from_config(config, rotary_dim: int) -> tuple[InterleavedRotary, float]:
    """(the rotary of an HF DeepSeek config, the softmax-scale multiplier mscale(f,
    mscale_all_dim)^2 or 1). Reads transformers 5's `rope_parameters` (a legacy `rope_scaling`
    is folded into it by the config class) and, failing that, `rope_scaling`. `rotary_dim` is
    `qk_rope_head_dim` (config.json's `head_dim` equals it; the head size is nope + rope)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params.get("factor") and isinstance(legacy, dict):
        params = {**legacy, **params}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    default_freq = 1.0 / (
        base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim)
    )
    if rope_type == "default":
        return InterleavedRotary(rotary_dim, default_freq), 1.0
    if rope_type != "yarn":
        raise ValueError(f"rope_type {rope_type!r} is not supported for MLA (only default, yarn)")
    for key in ("factor", "original_max_position_embeddings"):
        if params.get(key) is None:
            raise ValueError(f"rope_parameters of type yarn need {key!r}")
    factor = float(params["factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    inv_freq = _yarn_inv_freq(
        rotary_dim,
        base,
        factor,
        int(params["original_max_position_embeddings"]),
        float(params.get("beta_fast") or 32),
        float(params.get("beta_slow") or 1),
        bool(params.get("truncate", True)),
    )
    scale_mult = yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return InterleavedRotary(rotary_dim, inv_freq, float(attention_factor)), scale_mult
