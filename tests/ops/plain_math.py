"""Plain PyTorch formulas of the elementwise math the models use, written out in the tests: the
fused references (deltaserve/ops/fused/reference.py) must equal them bit for bit. Each rounds
where the models' HF counterparts round (statistics in float32, the weight product in the
activation dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """norm(x) * w, or norm(x) * (1 + w) when zero-centred (Qwen3.5)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (xf * (1.0 + w.float())).to(x.dtype)
    return w * xf.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * norm(x) * silu(z): the GDN output norm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = w * xf.to(x.dtype)
    return (y * F.silu(z.float())).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [.., 2 * d] = [gate | up] -> silu(gate) * up [.., d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """NeoX rotary over the first rotary_dim channels of x [T, H, D], in float32."""
    half = rotary_dim // 2
    rot = x[..., :rotary_dim].float()
    x1, x2 = rot[..., :half], rot[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, half]
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)
