"""Triton per-head q/k RMSNorm + partial NeoX rotary, for q and k in one launch.

For each head row x [D] of q [T, Hq, D] and k [T, Hk, D]:
    n = rmsnorm(x) * w (or * (1 + w)), rounded to x's dtype
    n[:half], n[half:rd] = n1 * cos - n2 * sin, n2 * cos + n1 * sin   (float32, then rounded)
    n[rd:] passes through                                         (layers.rotary, partial)
with rd = rotary_dim = 2 * half. cos / sin are `RotaryEmbedding.cos_sin(positions)` [T, half]
float32: computed once per step and shared by every attention layer, they keep the kernel free
of transcendental functions and bit-equal to the reference's angles.

Each program loads its head rows whole and, for the rotation, a second time with each channel's
rotary partner in its place (j <-> j + half below rd; a cache hit), so no register shuffle is
needed and every load and store covers whole rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.fused._common import TILE, check_out, check_weight, rows_of


@triton.jit
def _norm_rope_heads(
    x_ptr,
    out_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    t,  # int64 token index
    head0,  # first head of this program
    H,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_sin,
    eps,
    D: tl.constexpr,
    HALF: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Norm + rotary of heads head0 .. head0 + BLOCK_H - 1 of token t (masked past H)."""
    dtype = x_ptr.dtype.element_ty
    heads = head0 + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    mask = (heads < H)[:, None] & col_mask[None, :]
    # the rotary partner of each channel: j <-> j + HALF below 2 * HALF, itself above
    first = cols < HALF
    rotated = cols < 2 * HALF
    partner = tl.where(first, cols + HALF, tl.where(rotated, cols - HALF, cols))
    x_row = x_ptr + t * stride_xt + heads.to(tl.int64)[:, None] * stride_xh  # [BLOCK_H, 1]
    x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_row + partner[None, :], mask=mask, other=0.0).to(tl.float32)  # cache hit
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # [BLOCK_H, 1]
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(w_ptr + partner, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if ZERO_CENTERED:
        n = (x * rstd * (1.0 + w)).to(dtype).to(tl.float32)
        n_p = (xp * rstd * (1.0 + wp)).to(dtype).to(tl.float32)
    else:
        n = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        n_p = (wp * (xp * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # out = n * cos - n_partner * sin (first half), n * cos + n_partner * sin (second half),
    # n (pass-through: cos 1, sin 0)
    j = tl.where(first, cols, cols - HALF)
    c = tl.load(cos_ptr + t * stride_cos + j, mask=rotated, other=1.0)[None, :]
    s = tl.load(sin_ptr + t * stride_sin + j, mask=rotated, other=0.0)[None, :]
    s = tl.where(first, -s, s)
    o_row = out_ptr + t * stride_ot + heads.to(tl.int64)[:, None] * stride_oh
    tl.debug_barrier()  # every partner load is done before any store (in-place use)
    tl.store(o_row + cols[None, :], (n * c + n_p * s).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    Hq,
    Hk,
    num_q_blocks,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_sin,
    eps,
    D: tl.constexpr,
    HALF: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, num_q_blocks + num_k_blocks): a block of BLOCK_H q or k heads of one token."""
    pdl.wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    if hb < num_q_blocks:
        _norm_rope_heads(
            q_ptr, qo_ptr, qw_ptr, cos_ptr, sin_ptr, t, hb * BLOCK_H, Hq,
            stride_qt, stride_qh, stride_qot, stride_qoh, stride_cos, stride_sin, eps,
            D, HALF, ZERO_CENTERED, BLOCK_H, BLOCK_D,
        )  # fmt: skip
    else:
        _norm_rope_heads(
            k_ptr, ko_ptr, kw_ptr, cos_ptr, sin_ptr, t, (hb - num_q_blocks) * BLOCK_H, Hk,
            stride_kt, stride_kh, stride_kot, stride_koh, stride_cos, stride_sin, eps,
            D, HALF, ZERO_CENTERED, BLOCK_H, BLOCK_D,
        )  # fmt: skip


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    zero_centered: bool = False,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_norm / k_norm per head, then NeoX rotary on the first rotary_dim channels.

    q: [T, Hq, D], k: [T, Hk, D], same dtype; any strides with a unit last stride (e.g. the
        query half of Qwen3.5's per-head `[query | gate]`, or column slices of a qkv output).
    q_weight, k_weight: [D] contiguous, in q's dtype (or float32 when `zero_centered`).
    cos, sin: [T, rotary_dim / 2] float32 (`RotaryEmbedding.cos_sin(positions)`), unit last
        stride; rotary_dim = 2 * cos.shape[1] <= D.
    q_out, k_out: optional destinations (q's / k's shape and dtype; may be q / k themselves, the
        kernel reads a head row whole before writing it); else new contiguous tensors.
    Returns (q_out, k_out).
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D]")
    if k.dtype != q.dtype:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) dtypes differ")
    T, Hq, D = q.shape
    Hk = k.shape[1]
    half = cos.shape[-1]
    if cos.shape != (T, half) or sin.shape != (T, half) or 2 * half > D:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} for q {tuple(q.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("cos and sin must be float32")
    if half and (cos.stride(1) != 1 or sin.stride(1) != 1):
        raise ValueError("cos and sin need a unit last stride")
    rq, rk = rows_of(q, "q"), rows_of(k, "k")
    check_weight(q_weight, D, "q_weight")
    check_weight(k_weight, D, "k_weight")
    q_out = check_out(q_out, q, "q_out")
    k_out = check_out(k_out, k, "k_out")
    rqo, rko = rows_of(q_out, "q_out"), rows_of(k_out, "k_out")
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(TILE // block_d, triton.next_power_of_2(max(Hq, Hk))))
    num_warps = max(1, min(8, block_h * block_d // 512))
    num_q_blocks = triton.cdiv(Hq, block_h)
    grid = (T, num_q_blocks + triton.cdiv(Hk, block_h))
    if T:
        _qk_norm_rope_kernel[grid](
            q, k, q_out, k_out, q_weight, k_weight, cos, sin,
            Hq, Hk, num_q_blocks,
            rq.stride_t, rq.stride_h, rk.stride_t, rk.stride_h,
            rqo.stride_t, rqo.stride_h, rko.stride_t, rko.stride_h,
            cos.stride(0), sin.stride(0), eps,
            D=D, HALF=half, ZERO_CENTERED=zero_centered, BLOCK_H=block_h, BLOCK_D=block_d,
            num_warps=num_warps,
            **pdl.launch_kwargs(q),
        )  # fmt: skip
    return q_out, k_out
