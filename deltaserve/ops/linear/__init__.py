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


class TorchDecodeGemm:
    """The reference: F.linear (cuBLAS on CUDA)."""

    name = "torch"
    supports_cuda_graph = True  # F.linear: no host sync

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)


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
