"""RMSNorm weights. The math runs in the fused ops (deltaserve/ops/fused: a torch reference
beside the Triton kernels); these modules hold the weight, eps and the zero-centred flag."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = norm(x) * w, or norm(x) * (1 + w) when `zero_centered` (Qwen3.5, Qwen3-Next);
    statistics in float32. Applied by `ctx.kernels.fused.rms_norm`."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.zero_centered = zero_centered


class GatedRMSNorm(nn.Module):
    """y = w * norm(x) * silu(z): the GDN output norm (plain weight, not zero-centred). Applied
    by `ctx.kernels.fused.gated_rms_norm`."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
