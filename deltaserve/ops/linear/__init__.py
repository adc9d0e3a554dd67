"""Decode GEMMs: `y = x @ W.T (+ b)` for the few rows of a decode step.

At decode batch 1..16 every projection is a stream of its weight matrix: the kernel's job is to
read W at the copy rate. cuBLAS reaches ~88% of it on the per-layer shapes of a 9B model (its
lm_head, a much taller matrix, reaches the read peak). The Triton kernels tile W by output
rows and stream K with a deep software pipeline, one tensor-core dot per tile (or CUDA-core
FMAs for M <= 4). One-row steps run the GEMV (triton_gemv.py: CUDA-core FMAs over wide K
chunks, narrow column tiles, W's first chunks read before the PDL wait). The base one
(triton_gemm.py: one program per column tile, autotuned per shape and row padding) serves the
other steps of up to 64 rows (DELTASERVE_DECODE_GEMM_MAX_ROWS); above
16 rows only on weights of at most 2048 output rows, where it beat cuBLAS at 64 rows (cuBLAS
serves the larger ones: triton_gemm.WIDE_TRITON_MAX_N). The split-K one (triton_splitk.py)
splits K across programs, summing the slices in the last program of each tile in one launch;
it serves only DELTASERVE_DECODE_GEMM_KERNEL=splitk (the base kernel measured faster:
triton_gemm.decode_gemm).

Backends (op family `decode_gemm`, chosen at start-up): `triton` (CUDA, bf16 / fp16) and `torch`
(F.linear, the reference). The chosen one is attached to every linear layer of the model
(`attach_decode_gemm`); a layer calls it when its input has at most `MAX_ROWS` rows and uses
F.linear otherwise (prefill).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16  # decode steps of up to this many rows use the decode GEMM
# the most rows the Triton kernels serve (their dot step pads x to 16, 32 or 64 rows); steps of
# MAX_ROWS + 1 .. WIDE_MAX_ROWS rows reach them (DELTASERVE_DECODE_GEMM_MAX_ROWS, default
# WIDE_MAX_ROWS) only for weights of at most triton_gemm.WIDE_TRITON_MAX_N output rows
WIDE_MAX_ROWS = 64


def interpreting() -> bool:
    """True when Triton runs the kernels in its CPU interpreter (TRITON_INTERPRET=1, tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


DecodeGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class NormedInput:
    """A projection's input still to be formed: `rms_norm(h + residual)` (a decoder layer's
    residual add and norm), handed to the block's first projection so that the decode GEMM can
    run the norm in the same launch (`DecodeGemm.add_norm`). The new stream h + residual goes
    to `residual_out`, and rms_norm(h + residual) also to `normed_out` when it is given (a
    block that reads its input again, the MoE experts)."""

    h: torch.Tensor  # [1, K]
    residual: torch.Tensor  # [1, K], read only
    norm_weight: torch.Tensor  # [K]
    eps: float
    zero_centered: bool
    residual_out: torch.Tensor  # [1, K], written
    normed_out: torch.Tensor | None = None  # [1, K], written when given

    @property
    def shape(self) -> torch.Size:
        return self.h.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.h.dtype

    @property
    def device(self) -> torch.device:
        return self.h.device


@dataclass(frozen=True)
class ConvEpilogue:
    """GDN's causal conv1d update on the first `channels` output columns of a one-row
    projection (its fused in_proj, [q | k | v] first), for the decode GEMM to run in the same
    launch (`DecodeGemm.conv`): those columns come back as silu(conv) of the product (rounded
    to the activation dtype first, as the projection stores it), and the row's conv-state slot
    shifts by one in place, as ops/gdn's `conv1d_decode` would do after the projection."""

    weight: torch.Tensor  # [C, W] the depthwise taps (tap W - 1 multiplies the newest input)
    state: torch.Tensor  # [num_slots, C, W - 1] the conv-state pool, updated in place
    slot: torch.Tensor  # [1] int64: the row's slot

    @property
    def channels(self) -> int:
        return self.weight.shape[0]

    def check(self) -> None:
        """The layout the kernels assume, or a ValueError naming what differs."""
        c, w = self.weight.shape
        if self.state.dim() != 3 or self.state.shape[1:] != (c, w - 1):
            raise ValueError(
                f"conv state {tuple(self.state.shape)} does not match a [slots, {c}, {w - 1}] "
                f"pool for a [{c}, {w}] conv weight"
            )
        if self.slot.dtype != torch.int64 or self.slot.numel() < 1:
            raise ValueError(f"the conv slot must be an int64 tensor, got {self.slot.dtype}")


def conv_linear(
    x: torch.Tensor | NormedInput,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv: ConvEpilogue,
) -> torch.Tensor:
    """The reference of `DecodeGemm.conv`: the projection (`add_norm_linear` for a
    `NormedInput`), then the reference conv1d decode on its first `conv.channels` columns."""
    from deltaserve.ops.gdn.reference import causal_conv1d_ref

    if isinstance(x, NormedInput):
        y = add_norm_linear(x, weight, bias)
    else:
        y = F.linear(x, weight, bias)
    c = conv.channels
    slot = int(conv.slot.reshape(-1)[0])
    has_init = torch.ones(1, dtype=torch.bool, device=y.device)
    y[:, :c] = causal_conv1d_ref(y[:, :c], conv.weight, conv.state, [0, 1], [slot], has_init)
    return y


def add_norm_linear(
    x: NormedInput, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference of `DecodeGemm.add_norm`: the fused ops' torch rms_norm, then F.linear
    (fills x.residual_out and x.normed_out as the fused kernel does)."""
    from deltaserve.ops.fused.reference import rms_norm

    x.residual_out.copy_(x.residual)
    y, _ = rms_norm(x.h, x.norm_weight, x.eps, x.zero_centered, residual=x.residual_out)
    if x.normed_out is not None:
        x.normed_out.copy_(y)
    return F.linear(y, weight, bias)


class TorchDecodeGemm:
    """The reference: F.linear (cuBLAS on CUDA)."""

    name = "torch"
    supports_cuda_graph = True  # F.linear: no host sync

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def fuses_add_norm(self, rows: int, k: int) -> bool:
        """Whether `add_norm` saves anything at this many rows of width k: never here (the
        layers then run the norm and the projection as two ops)."""
        return False

    def fuses_conv(self, rows: int) -> bool:
        """Whether `conv` saves a launch at this many rows: never here (the GDN layer then
        runs the projection and its conv backend as two ops)."""
        return False

    add_norm = staticmethod(add_norm_linear)
    conv = staticmethod(conv_linear)


def attach_decode_gemm(model: nn.Module, gemm: DecodeGemm | None) -> int:
    """Give every column- / row-parallel linear of `model` the decode GEMM (None: plain
    F.linear everywhere). Returns how many layers got it."""
    from deltaserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear

    n = 0
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            module.decode_gemm = gemm
            n += 1
    return n
