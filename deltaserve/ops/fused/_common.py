"""Shared launch helpers for the fused Triton kernels.

The kernels address a tensor [..., N] as rows of N contiguous elements: row `r` of a [T, H, N]
view starts at `(r // H) * stride_t + (r % H) * stride_h`. This covers contiguous tensors,
column slices of a projection output (row stride > N) and per-head views such as the query half
of Qwen3.5's per-head `[query | gate]` layout (stride_h = 2 * D), without a copy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# elements per program for the row-tiled kernels: 8-16 per thread at 4-8 warps
TILE = 2048


class Rows(NamedTuple):
    """A tensor seen as T x H rows of N unit-stride elements."""

    T: int
    H: int
    N: int
    stride_t: int
    stride_h: int

    @property
    def num_rows(self) -> int:
        return self.T * self.H


def rows_of(x: torch.Tensor, name: str = "x") -> Rows:
    """Row addressing of x [..., N] (1 to 3 dims, or more if the leading dims merge into one)."""
    if x.dim() == 0 or (x.stride(-1) != 1 and x.shape[-1] > 1):
        raise ValueError(f"{name}: the last dim must have unit stride (strides {x.stride()})")
    if x.dim() == 1:
        return Rows(1, 1, x.shape[0], x.shape[0], 0)
    if x.dim() == 2:
        return Rows(x.shape[0], 1, x.shape[1], x.stride(0), 0)
    if x.dim() > 3:
        try:
            x = x.view(-1, x.shape[-2], x.shape[-1])
        except RuntimeError as e:
            raise ValueError(f"{name}: leading dims of {tuple(x.shape)} do not merge") from e
    return Rows(x.shape[0], x.shape[1], x.shape[2], x.stride(0), x.stride(1))


def check_out(
    out: torch.Tensor | None,
    like: torch.Tensor,
    name: str = "out",
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """`out` checked against `like`'s dtype and device and `shape` (default: like's), or a new
    contiguous tensor."""
    shape = tuple(like.shape) if shape is None else shape
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"{name} is {tuple(out.shape)} {out.dtype} on {out.device}, expected "
            f"{shape} {like.dtype} on {like.device}"
        )
    return out


def check_weight(weight: torch.Tensor, n: int, name: str = "weight") -> None:
    if weight.shape != (n,) or weight.stride(0) != 1:
        raise ValueError(f"{name} must be a contiguous [{n}] vector, got {tuple(weight.shape)}")


def row_tile(num_rows: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_N, num_warps) for kernels that reduce whole rows of n elements."""
    block_n = triton.next_power_of_2(n)
    block_r = max(1, min(TILE // block_n, triton.next_power_of_2(max(num_rows, 1))))
    tile = block_r * block_n
    num_warps = max(1, min(16, tile // 512))
    return block_r, block_n, num_warps


@triton.jit
def row_starts(rows, H, stride_t, stride_h):
    """int64 offsets of the first element of each row (rows: int32 tensor of row indices)."""
    t = (rows // H).to(tl.int64)
    h = (rows % H).to(tl.int64)
    return t * stride_t + h * stride_h


@triton.jit
def silu_f32(x):
    """x * sigmoid(x) in float32, as torch computes it: x / (1 + exp(-x))."""
    return x / (1.0 + tl.exp(-x))
