"""Fused elementwise ops of a decoder layer: norms (with the residual add), gates, q/k norm +
rotary. One implementation is chosen at start-up (`load_fused_ops`) and used by every layer.

Why fused: at decode batch 1 every small kernel in a CUDA graph costs ~2-4 us, so the per-layer
elementwise work must be a few launches. With these ops a decoder layer needs:

    h, residual = ops.rms_norm(x, w_in, eps, zc, residual=residual)     # add + norm, 1 launch
    ... mixer ... (attention: qk_norm_rope 1 launch, sigmoid_gate_mul 1 launch;
                   GDN: gated_rms_norm 1 launch)
    h, residual = ops.rms_norm(mixer_out, w_post, eps, zc, residual=residual)
    ... mlp: silu_and_mul 1 launch ...

Semantics shared by every implementation (the torch reference is the definition; see
`reference.py`, bit-equal to `deltaserve.layers`):

- Outputs are in the input's dtype; statistics and activations are computed in float32, and
  intermediates are rounded to the input dtype where the layer code rounds them.
- `out=` (and `q_out=` / `k_out=`): when given, the result is written there and returned; it may
  alias the input. Otherwise a new contiguous tensor is returned.
- `rms_norm(..., residual=r)` overwrites `r` IN PLACE with `x + r` (rounded to x's dtype, as
  the unfused `x = x + mixer(x)` does) and returns `(norm(x + r), r)`.
- Inputs may be strided views with a unit last stride (a projection's column slice, a per-head
  half of `[query | gate]`); no op copies its inputs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from abc import ABC, abstractmethod

import torch

from deltaserve.ops.fused import reference

FUSED_OPS = {
    "torch": "deltaserve.ops.fused:TorchFusedOps",
    "triton": "deltaserve.ops.fused.triton_ops:TritonFusedOps",
}


class FusedOps(ABC):
    """The fused elementwise ops a model's layers call. Shapes: T tokens, H heads, N / D / d
    the normalised or gated width. Every op is CUDA-graph safe (no host sync, no host reads)."""

    name: str = "?"
    supports_cuda_graph: bool = False  # True: no host sync or host-list read in any op

    @abstractmethod
    def rms_norm(
        self,
        x: torch.Tensor,  # [T, N] or [T, H, D]
        weight: torch.Tensor,  # [N]
        eps: float,
        zero_centered: bool = False,  # norm(x) * (1 + w) instead of norm(x) * w
        residual: torch.Tensor | None = None,  # x's shape and dtype; overwritten with x + r
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x) (no residual) or (norm(x + residual), residual) with residual updated."""

    @abstractmethod
    def gated_rms_norm(
        self,
        x: torch.Tensor,  # [T, HV, V]
        z: torch.Tensor,  # [T, HV, V], may be a strided view
        weight: torch.Tensor,  # [V]
        eps: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """w * norm(x) * silu(z) over the last dim (GDN output norm; plain weight)."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, 2d] = [gate | up] -> silu(gate) * up [T, d]."""

    @abstractmethod
    def sigmoid_gate_mul(
        self,
        o: torch.Tensor,  # [T, Hq, D] (or [T, N])
        gate: torch.Tensor,  # o's shape, may be a strided view
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """o * sigmoid(gate) (Qwen3.5 gated attention output)."""

    @abstractmethod
    def qk_norm_rope(
        self,
        q: torch.Tensor,  # [T, Hq, D], may be a strided view
        k: torch.Tensor,  # [T, Hk, D], may be a strided view
        q_weight: torch.Tensor,  # [D]
        k_weight: torch.Tensor,  # [D]
        cos: torch.Tensor,  # [T, rotary_dim / 2] float32
        sin: torch.Tensor,  # [T, rotary_dim / 2] float32
        eps: float,
        zero_centered: bool = False,
        q_out: torch.Tensor | None = None,
        k_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k, then NeoX rotary on their first rotary_dim channels."""

    @abstractmethod
    def mla_rope_norm(
        self,
        q_pe: torch.Tensor,  # [T, H, P], may be a strided view
        kv_a: torch.Tensor,  # [T, R + P] = [c_kv | k_pe], may be a column slice
        weight: torch.Tensor,  # [R] kv_a_layernorm
        cos: torch.Tensor,  # [T, P / 2] float32
        sin: torch.Tensor,  # [T, P / 2] float32
        eps: float,
        q_pe_out: torch.Tensor | None = None,
        latent_out: torch.Tensor | None = None,  # [T, R + P]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA (DeepSeek-V2): interleaved-pair rotary of q_pe, and the step's latent rows
        `[rms_norm(c_kv) * w | rotated k_pe]`."""

    @abstractmethod
    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, V] -> [R] int64: the index of each row's first maximum (the sampler's greedy
        choice and exponential race)."""

    @abstractmethod
    def copy_rows(self, tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """`t[dst[i]] = t[src[i]]` in every tensor t (state pools, rows along dim 0, contiguous)
        for every i (src / dst [C] int64 on the device); no row is both read and written, none
        written twice. Prefix-cache restores and snapshots (cache/ops.py)."""


class TorchFusedOps(FusedOps):
    """The reference: a few torch ops per call, any device and dtype."""

    name = "torch"
    supports_cuda_graph = True  # plain tensor ops on the inputs; no batch metadata at all

    rms_norm = staticmethod(reference.rms_norm)
    gated_rms_norm = staticmethod(reference.gated_rms_norm)
    silu_and_mul = staticmethod(reference.silu_and_mul)
    sigmoid_gate_mul = staticmethod(reference.sigmoid_gate_mul)
    qk_norm_rope = staticmethod(reference.qk_norm_rope)
    mla_rope_norm = staticmethod(reference.mla_rope_norm)
    argmax = staticmethod(reference.argmax)
    copy_rows = staticmethod(reference.copy_rows)


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton ops cannot run on `device` (None when they can): they need triton and a
    CUDA device, or a CPU device under Triton's interpreter (TRITON_INTERPRET=1, tests only)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    device = torch.device(device)
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"device {device.type} unsupported (CUDA only; CPU only under TRITON_INTERPRET=1)"


def load_fused_ops(name: str) -> FusedOps:
    """The implementation registered as `name` ("torch" or "triton"), imported on first use."""
    try:
        target = FUSED_OPS[name]
    except KeyError:
        raise ValueError(f"unknown fused ops {name!r}; known: {sorted(FUSED_OPS)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["FUSED_OPS", "FusedOps", "TorchFusedOps", "load_fused_ops", "triton_unavailable_reason"]
