"""Triton RMSNorm with an optional fused residual add, over hidden rows or per-head views.

One kernel serves the decoder layer norms (`x [T, hidden]`, hidden up to 8192: one row per
program) and the per-head q_norm / k_norm (`x [T, H, D]`, possibly a strided view: several rows
per program). Numerics follow `reference.rms_norm` (HF's RMSNorm math): the
residual sum is rounded to x's dtype, statistics are float32, and without `zero_centered` the
normalised row is rounded to x's dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.fused._common import check_out, check_weight, row_starts, row_tile, rows_of


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # rows of N
    res_ptr,  # rows of N, read and overwritten with x + residual (HAS_RESIDUAL)
    w_ptr,  # [N]
    out_ptr,  # rows of N
    num_rows,
    H,
    N,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_rh,
    stride_ot,
    stride_oh,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (cdiv(num_rows, BLOCK_R),): BLOCK_R whole rows per program."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_mask = cols < N
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    pdl.wait(PDL)  # the weight is loaded while the previous kernel finishes (ops/pdl.py)
    mask = (rows < num_rows)[:, None] & col_mask[None, :]
    dtype = x_ptr.dtype.element_ty
    x_offs = row_starts(rows, H, stride_xt, stride_xh)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_offs = row_starts(rows, H, stride_rt, stride_rh)[:, None] + cols[None, :]
        r = tl.load(res_ptr + r_offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the unfused add, in x's dtype
        tl.store(res_ptr + r_offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)  # [BLOCK_R]
    xn = xf * rstd[:, None]
    if ZERO_CENTERED:
        y = xn * (1.0 + w)
    else:
        y = w * xn.to(dtype).to(tl.float32)
    o_offs = row_starts(rows, H, stride_ot, stride_oh)[:, None] + cols[None, :]
    tl.store(out_ptr + o_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim: `norm(r) * w`, or `norm(r) * (1 + w)` when `zero_centered`.

    x: [N], [T, N] or [T, H, N] (more dims if the leading ones merge); any strides with a unit
        last stride, e.g. the query half of a per-head `[query | gate]` projection.
    weight: [N] contiguous, in x's dtype (or float32 when `zero_centered`).
    residual: optional, x's shape and dtype, any unit-last-stride layout. When given,
        r = x + residual (rounded to x's dtype) is written into `residual` IN PLACE and
        `(out, residual)` is returned; otherwise r = x and `out` is returned.
    out: optional destination (x's shape and dtype; may be x itself, but not `residual`); else
        a new contiguous tensor.
    """
    rx = rows_of(x)
    check_weight(weight, rx.N)
    out = check_out(out, x)
    ro = rows_of(out, "out")
    if residual is not None:
        check_out(residual, x, "residual")
        rr = rows_of(residual, "residual")
    else:
        rr = rx
    block_r, block_n, num_warps = row_tile(rx.num_rows, rx.N)
    if rx.num_rows:
        _rms_norm_kernel[(triton.cdiv(rx.num_rows, block_r),)](
            x,
            x if residual is None else residual,
            weight,
            out,
            rx.num_rows,
            rx.H,
            rx.N,
            rx.stride_t,
            rx.stride_h,
            rr.stride_t,
            rr.stride_h,
            ro.stride_t,
            ro.stride_h,
            eps,
            HAS_RESIDUAL=residual is not None,
            ZERO_CENTERED=zero_centered,
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            num_warps=num_warps,
            **pdl.launch_kwargs(x),
        )
    if residual is None:
        return out
    return out, residual
