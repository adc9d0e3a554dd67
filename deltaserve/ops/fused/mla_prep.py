"""Triton MLA step preparation in one launch: the query heads' rope part rotated, and the
step's latent rows `[kv_a_layernorm(c_kv) | rotated k_pe]` built (DeepSeek-V2's interleaved
rotary: pairs (2i, 2i + 1) turned by angle i, in float32, rounded once).

For token t (one program):
    q_pe[t, h, 2i], q_pe[t, h, 2i + 1] = x0 c - x1 s, x0 s + x1 c         (every head h)
    latent[t, :R] = w * (c_kv[t] * rstd).to(dtype)                   (plain RMSNorm, float32 stats)
    latent[t, R:] = k_pe[t] rotated as above
with c, s = cos[t, i], sin[t, i] (`InterleavedRotary.cos_sin`). Each channel's pair partner is
loaded a second time in its place (j ^ 1, a cache hit), so no register shuffle is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.fused._common import check_weight


@triton.jit
def _rotate_pairs(x_ptr, xp_ptr, c, s, mask, odd):
    """Interleaved rotation of the rows at x_ptr (partners at xp_ptr), float32."""
    x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(xp_ptr, mask=mask, other=0.0).to(tl.float32)
    return x * c + tl.where(odd, xp, -xp) * s


@triton.jit
def rope_norm_token(
    t,
    q_ptr,
    qo_ptr,
    kv_ptr,
    lat_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    H,
    stride_qt,
    stride_qh,
    stride_qot,
    stride_qoh,
    stride_kv,
    stride_lat,
    stride_cos,
    stride_sin,
    eps,
    R: tl.constexpr,
    P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Token t's share of the preparation (module docstring), after the PDL wait: its query
    heads' rope part rotated into qo, its latent row built into lat. Also run by the MLA
    backends' fused preparation kernel (ops/mla/triton_head_matmul.py)."""
    t = t.to(tl.int64)
    dtype = kv_ptr.dtype.element_ty
    j = tl.arange(0, BLOCK_P)
    j_mask = j < P
    partner = j ^ 1
    odd = (j % 2) == 1
    c = tl.load(cos_ptr + t * stride_cos + j // 2, mask=j_mask, other=1.0)
    s = tl.load(sin_ptr + t * stride_sin + j // 2, mask=j_mask, other=0.0)

    # query heads' rope part, [HEADS, BLOCK_P] at a time (at most 16 heads: the register
    # tiles of 128 heads spilled under a 2-warp tuning of the fused preparation kernel)
    HEADS: tl.constexpr = 16 if BLOCK_H > 16 else BLOCK_H
    for h0 in tl.static_range(0, BLOCK_H, HEADS):
        heads = (h0 + tl.arange(0, HEADS)).to(tl.int64)
        mask = (heads < H)[:, None] & j_mask[None, :]
        rows = q_ptr + t * stride_qt + heads[:, None] * stride_qh
        q = _rotate_pairs(rows + j[None, :], rows + partner[None, :], c[None, :], s[None, :],
                          mask, odd[None, :])  # fmt: skip
        tl.debug_barrier()  # every partner load of these heads is done before a store (in place)
        o_rows = qo_ptr + t * stride_qot + heads[:, None] * stride_qoh
        tl.store(o_rows + j[None, :], q.to(qo_ptr.dtype.element_ty), mask=mask)
    # latent: normed c_kv and rotated k_pe
    kv_row = kv_ptr + t * stride_kv
    k = _rotate_pairs(kv_row + R + j, kv_row + R + partner, c, s, j_mask, odd)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    x = tl.load(kv_row + r, mask=r_mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / R + eps)
    w = tl.load(w_ptr + r, mask=r_mask, other=0.0).to(tl.float32)
    n = w * (x * rstd).to(dtype).to(tl.float32)
    lat_row = lat_ptr + t * stride_lat
    tl.store(lat_row + r, n.to(lat_ptr.dtype.element_ty), mask=r_mask)
    tl.store(lat_row + R + j, k.to(lat_ptr.dtype.element_ty), mask=j_mask)


@triton.jit
def _mla_rope_norm_kernel(
    q_ptr,  # [T, H, P] (strided)
    qo_ptr,  # [T, H, P] (may alias q)
    kv_ptr,  # [T, R + P] rows (strided)
    lat_ptr,  # [T, R + P] out
    w_ptr,  # [R]
    cos_ptr,  # [T, P / 2] float32
    sin_ptr,
    H,
    stride_qt,
    stride_qh,
    stride_qot,
    stride_qoh,
    stride_kv,
    stride_lat,
    stride_cos,
    stride_sin,
    eps,
    R: tl.constexpr,
    P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    rope_norm_token(
        tl.program_id(0), q_ptr, qo_ptr, kv_ptr, lat_ptr, w_ptr, cos_ptr, sin_ptr, H,
        stride_qt, stride_qh, stride_qot, stride_qoh, stride_kv, stride_lat, stride_cos,
        stride_sin, eps, R, P, BLOCK_H, BLOCK_R, BLOCK_P,
    )  # fmt: skip


def check_rope_norm_args(
    q_pe: torch.Tensor,
    kv_a: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_pe_out: torch.Tensor | None = None,
    latent_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_rope_norm`'s argument checks -> (q_pe_out, latent_out), new contiguous tensors
    where not given."""
    if q_pe.dim() != 3 or kv_a.dim() != 2 or q_pe.shape[0] != kv_a.shape[0]:
        raise ValueError(f"q_pe {tuple(q_pe.shape)} / kv_a {tuple(kv_a.shape)}: need [T, H, P]"
                         " and [T, R + P]")  # fmt: skip
    T, H, P = q_pe.shape
    R = kv_a.shape[1] - P
    if P % 2 or R <= 0 or cos.shape != (T, P // 2) or sin.shape != (T, P // 2):
        raise ValueError(
            f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not fit q_pe {tuple(q_pe.shape)}"
        )
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("cos and sin must be float32")
    if q_pe.stride(-1) != 1 or kv_a.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("q_pe, kv_a, cos and sin need a unit last stride")
    check_weight(weight, R, "weight")
    if q_pe_out is None:
        q_pe_out = torch.empty(T, H, P, dtype=q_pe.dtype, device=q_pe.device)
    if latent_out is None:
        latent_out = torch.empty(T, R + P, dtype=kv_a.dtype, device=kv_a.device)
    if q_pe_out.shape != q_pe.shape or latent_out.shape != kv_a.shape:
        raise ValueError("q_pe_out / latent_out do not match q_pe / kv_a")
    if q_pe_out.stride(-1) != 1 or latent_out.stride(-1) != 1:
        raise ValueError("q_pe_out and latent_out need a unit last stride")
    return q_pe_out, latent_out


def mla_rope_norm(
    q_pe: torch.Tensor,
    kv_a: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    q_pe_out: torch.Tensor | None = None,
    latent_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLA step's rope and latent norm in one launch (module docstring).

    q_pe: [T, H, P], any strides with a unit last stride (the rope part of q's heads).
    kv_a: [T, R + P] `[c_kv | k_pe]` rows (kv_a_proj_with_mqa's output, may be a column slice).
    weight: kv_a_layernorm's [R], in kv_a's dtype. cos, sin: [T, P / 2] float32.
    q_pe_out: optional destination for the rotated q_pe (may be q_pe itself); latent_out:
        optional [T, R + P] destination (unit last stride). Else new contiguous tensors.
    Returns (q_pe_out, latent_out).
    """
    q_pe_out, latent_out = check_rope_norm_args(q_pe, kv_a, weight, cos, sin, q_pe_out, latent_out)
    T, H, P = q_pe.shape
    R = kv_a.shape[1] - P
    block_h = triton.next_power_of_2(H)
    block_p = triton.next_power_of_2(P)
    if T:
        _mla_rope_norm_kernel[(T,)](
            q_pe, q_pe_out, kv_a, latent_out, weight, cos, sin, H,
            q_pe.stride(0), q_pe.stride(1), q_pe_out.stride(0), q_pe_out.stride(1),
            kv_a.stride(0), latent_out.stride(0), cos.stride(0), sin.stride(0), eps,
            R=R, P=P, BLOCK_H=block_h, BLOCK_R=triton.next_power_of_2(R), BLOCK_P=block_p,
            num_warps=max(1, min(8, block_h * block_p // 512)),
            **pdl.launch_kwargs(q_pe),
        )  # fmt: skip
    return q_pe_out, latent_out
