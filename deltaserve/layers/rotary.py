"""Rotary position embedding, NeoX style (rotate halves), full or partial."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deltaserve.forward_context import ForwardContext


class RotaryEmbedding:
    """Rotates the first `rotary_dim` channels of each head; the rest pass through.

    Holds no parameters or buffers (so models built on the meta device need no init);
    the inverse frequencies are moved to the input's device on first use.
    """

    def __init__(self, head_dim: int, rotary_dim: int, base: float) -> None:
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"bad rotary_dim {rotary_dim} for head_dim {head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = base
        self._inv_freq = 1.0 / (
            base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim)
        )
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def _inv(self, device: torch.device) -> torch.Tensor:
        inv = self._by_device.get(device)
        if inv is None:
            inv = self._by_device[device] = self._inv_freq.to(device)
        return inv

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim / 2] in float32."""
        freqs = positions.float()[:, None] * self._inv(positions.device)[None, :]
        return freqs.cos(), freqs.sin()


def rotary_cos_sin(
    rotary: RotaryEmbedding, positions: torch.Tensor, ctx: ForwardContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim / 2] of the step's positions, computed once per step (memoised in
    `ctx.memo`, shared by every layer with the same rotary)."""
    key = ("rotary", rotary.rotary_dim, rotary.base)
    cached = ctx.memo.get(key)
    if cached is None:
        cached = ctx.memo[key] = rotary.cos_sin(positions)
    return cached


def rope_from_config(config, head_dim: int) -> RotaryEmbedding:
    """Build the rotary embedding from an HF text config (rope_parameters or legacy keys)."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"rope_type {rope_type!r} is not supported yet (only 'default')")
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    return RotaryEmbedding(head_dim, rotary_dim, float(base))
