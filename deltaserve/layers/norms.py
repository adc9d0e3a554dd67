"""RMSNorm variants. Statistics are computed in float32 (DESIGN.md invariant 7)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = norm(x) * w, or norm(x) * (1 + w) when `zero_centered` (Qwen3.5, Qwen3-Next)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """y = w * norm(x) * silu(z): the GDN output norm (plain weight, not zero-centred)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)
