"""Triton gated RMSNorm, the GDN output norm: `w * norm(x) * silu(z)` per value head.

Numerics follow `reference.gated_rms_norm` (`layers.norms.GatedRMSNorm`): float32 statistics,
`w * norm(x)` rounded to x's dtype, then multiplied by silu(z) in float32 and rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.fused._common import (
    check_out,
    check_weight,
    row_starts,
    row_tile,
    rows_of,
    silu_f32,
)


@triton.jit
def gated_norm_rows(xf, zf, w, N, eps, dtype: tl.constexpr):
    """Rows [R, BN] of x and z in float32, w [1, BN] float32 (zero past N) -> `w * norm(x) *
    silu(z)` in float32 with the reference's roundings: norm(x) and w * norm(x) rounded to
    `dtype` (GDN's output norm; also the Triton GDN decode's fused form, ops/gdn/
    triton_decode.py)."""
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
    xn = (xf * rstd[:, None]).to(dtype).to(tl.float32)
    y = (w * xn).to(dtype).to(tl.float32)
    return y * silu_f32(zf)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,  # rows of N
    z_ptr,  # rows of N
    w_ptr,  # [N]
    out_ptr,  # rows of N
    num_rows,
    H,
    N,
    stride_xt,
    stride_xh,
    stride_zt,
    stride_zh,
    stride_ot,
    stride_oh,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (cdiv(num_rows, BLOCK_R),): BLOCK_R whole rows (heads) per program."""
    pdl.wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    dtype = x_ptr.dtype.element_ty
    x_offs = row_starts(rows, H, stride_xt, stride_xh)[:, None] + cols[None, :]
    z_offs = row_starts(rows, H, stride_zt, stride_zh)[:, None] + cols[None, :]
    xf = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    zf = tl.load(z_ptr + z_offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = gated_norm_rows(xf, zf, w, N, eps, dtype)
    o_offs = row_starts(rows, H, stride_ot, stride_oh)[:, None] + cols[None, :]
    tl.store(out_ptr + o_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`w * rmsnorm(x) * silu(z)` over the last dim (the head dim, e.g. 128).

    x: [T, HV, V] (or [T, V] / [V]); any strides with a unit last stride.
    z: x's shape (any float dtype); any unit-last-stride view (e.g. the z columns of the GDN in_proj
        output reshaped to [T, HV, V]).
    weight: [V] contiguous, in x's dtype.
    out: optional destination (x's shape and dtype; may alias x); else a new contiguous tensor.
    """
    if z.shape != x.shape:
        raise ValueError(f"z {tuple(z.shape)} must have x's shape {tuple(x.shape)}")
    rx, rz = rows_of(x), rows_of(z, "z")
    check_weight(weight, rx.N)
    out = check_out(out, x)
    ro = rows_of(out, "out")
    block_r, block_n, num_warps = row_tile(rx.num_rows, rx.N)
    if rx.num_rows:
        _gated_rms_norm_kernel[(triton.cdiv(rx.num_rows, block_r),)](
            x,
            z,
            weight,
            out,
            rx.num_rows,
            rx.H,
            rx.N,
            rx.stride_t,
            rx.stride_h,
            rz.stride_t,
            rz.stride_h,
            ro.stride_t,
            ro.stride_h,
            eps,
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            num_warps=num_warps,
            **pdl.launch_kwargs(x),
        )
    return out
