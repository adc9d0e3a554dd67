"""Rotary position embedding, NeoX style (rotate halves), full or partial; M-RoPE.

M-RoPE (Qwen3.5 with images): positions are [3, T] (temporal, height, width) and frequency j
of the rotary half takes its angle from axis 1 (height) when j % 3 == 1 and j < 3 *
mrope_section[1], from axis 2 (width) when j % 3 == 2 and j < 3 * mrope_section[2], else from
axis 0 (temporal): HF's interleaved layout (Qwen3_5TextRotaryEmbedding, which interleaves
whatever `mrope_interleaved` says). The result is the same cos / sin [T, rotary_dim / 2] table
the kernels take, so only the table changes; 1-D positions [T] keep the plain path (equal to
M-RoPE with the same position on all three axes, whatever the sections).
"""

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

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        base: float,
        mrope_section: tuple[int, int, int] | None = None,
    ) -> None:
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"bad rotary_dim {rotary_dim} for head_dim {head_dim}")
        half = rotary_dim // 2
        if mrope_section is not None:
            # NOTE: HF applies the interleaving rule below whatever the sizes sum to (a preset
            # may pair a small head with the released sections): so do we
            if len(mrope_section) != 3:
                raise ValueError(f"mrope_section {list(mrope_section)} must have 3 sizes (t, h, w)")
            j = torch.arange(half, device="cpu")  # NOTE: models are built under a meta device
            axis = torch.zeros(half, dtype=torch.long, device="cpu")
            axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
            axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
            self._mrope_axis: torch.Tensor | None = axis  # [half]: the axis of each frequency
        else:
            self._mrope_axis = None
        self.mrope_section = mrope_section
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
        """positions [T] (or [3, T] with M-RoPE) -> cos, sin [T, rotary_dim / 2] float32."""
        inv = self._inv(positions.device)
        if positions.dim() == 1:
            freqs = positions.float()[:, None] * inv[None, :]
        else:
            if self._mrope_axis is None or positions.shape[0] != 3:
                raise ValueError(
                    f"positions of shape {tuple(positions.shape)} need a rotary with "
                    "mrope_section and 3 rows (temporal, height, width)"
                )
            per_axis = positions.float()[:, :, None] * inv  # [3, T, half]
            axis = self._mrope_axis.to(positions.device)  # [half]
            # frequency j from its axis: [T, half]
            freqs = per_axis.gather(0, axis.view(1, 1, -1).expand(1, positions.shape[1], -1))[0]
        return freqs.cos(), freqs.sin()


def rotary_cos_sin(
    rotary: RotaryEmbedding, positions: torch.Tensor, ctx: ForwardContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim / 2] of the step's positions, computed once per step (memoised in
    `ctx.memo`, shared by every layer with the same rotary)."""
    key = ("rotary", rotary.rotary_dim, rotary.base, rotary.mrope_section)
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
    section = params.get("mrope_section")
    section = tuple(int(x) for x in section) if section else None
    return RotaryEmbedding(head_dim, rotary_dim, float(base), section)
