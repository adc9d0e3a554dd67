"""Triton elementwise gates: `silu(gate) * up` (MLP) and `o * sigmoid(gate)` (gated attention).

Both round the activation to the input dtype before the product, as the layer code does in
bf16 (`F.silu(x[..., :d]) * x[..., d:]`, `o * torch.sigmoid(gate)`); see `reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.fused._common import check_out, row_starts, rows_of, silu_f32

BLOCK_COLS = 1024  # columns per program: 8 per thread at 4 warps


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # rows of 2 * d: [gate | up]
    out_ptr,  # rows of d
    H,
    d,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (num_rows, cdiv(d, BLOCK)): one row's BLOCK output columns per program."""
    pdl.wait(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = x_ptr.dtype.element_ty
    x_row = x_ptr + row_starts(row, H, stride_xt, stride_xh)
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    s = silu_f32(g).to(dtype).to(tl.float32)
    o_row = out_ptr + row_starts(row, H, stride_ot, stride_oh)
    tl.store(o_row + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2 * d] = [gate | up] -> silu(gate) * up [..., d].

    x: [T, 2d] (or [2d] / [T, H, 2d]); any row stride, unit last stride.
    out: optional destination [..., d] in x's dtype (any unit-last-stride layout); else a new
        contiguous tensor.
    """
    rx = rows_of(x)
    if rx.N % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {rx.N}")
    d = rx.N // 2
    out = check_out(out, x, shape=(*x.shape[:-1], d))
    ro = rows_of(out, "out")
    block = min(BLOCK_COLS, triton.next_power_of_2(max(d, 1)))
    if rx.num_rows and d:
        _silu_and_mul_kernel[(rx.num_rows, triton.cdiv(d, block))](
            x,
            out,
            rx.H,
            d,
            rx.stride_t,
            rx.stride_h,
            ro.stride_t,
            ro.stride_h,
            BLOCK=block,
            num_warps=4,
            **pdl.launch_kwargs(x),
        )
    return out


@triton.jit
def _sigmoid_gate_mul_kernel(
    o_ptr,  # rows of N
    g_ptr,  # rows of N
    out_ptr,  # rows of N
    num_rows,
    H,
    N,
    stride_ot,
    stride_oh,
    stride_gt,
    stride_gh,
    stride_yt,
    stride_yh,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (cdiv(num_rows, BLOCK_R), cdiv(N, BLOCK_N)): a [BLOCK_R, BLOCK_N] tile per program."""
    pdl.wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
    o_offs = row_starts(rows, H, stride_ot, stride_oh)[:, None] + cols[None, :]
    g_offs = row_starts(rows, H, stride_gt, stride_gh)[:, None] + cols[None, :]
    o = tl.load(o_ptr + o_offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
    sg = (1.0 / (1.0 + tl.exp(-g))).to(g_ptr.dtype.element_ty).to(tl.float32)
    y_offs = row_starts(rows, H, stride_yt, stride_yh)[:, None] + cols[None, :]
    tl.store(out_ptr + y_offs, (o * sg).to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_gate_mul(
    o: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """o * sigmoid(gate), elementwise.

    o: [T, N] or [T, H, D]; any unit-last-stride layout.
    gate: o's shape and dtype; any unit-last-stride view (e.g. the gate half of Qwen3.5's
        per-head `[query | gate]` q_proj output, [T, Hq, D] with head stride 2 * D).
    out: optional destination (o's shape and dtype; may be o itself); else a new contiguous
        tensor.
    """
    if gate.shape != o.shape or gate.dtype != o.dtype:
        raise ValueError(
            f"gate {tuple(gate.shape)} {gate.dtype} must match o {tuple(o.shape)} {o.dtype}"
        )
    ro, rg = rows_of(o, "o"), rows_of(gate, "gate")
    out = check_out(out, o)
    ry = rows_of(out, "out")
    block_n = min(BLOCK_COLS, triton.next_power_of_2(max(ro.N, 1)))
    block_r = max(1, min(BLOCK_COLS // block_n, triton.next_power_of_2(max(ro.num_rows, 1))))
    if ro.num_rows and ro.N:
        grid = (triton.cdiv(ro.num_rows, block_r), triton.cdiv(ro.N, block_n))
        _sigmoid_gate_mul_kernel[grid](
            o,
            gate,
            out,
            ro.num_rows,
            ro.H,
            ro.N,
            ro.stride_t,
            ro.stride_h,
            rg.stride_t,
            rg.stride_h,
            ry.stride_t,
            ry.stride_h,
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            num_warps=4,
            **pdl.launch_kwargs(o),
        )
    return out
