"""The decode GEMMs' input tile through its prologue (ops/linear/prologue.py says what and why):
one jitted helper both kernels (triton_gemm.py, triton_splitk.py) load x with."""

from __future__ import annotations

import triton
import triton.language as tl

from deltaserve.ops.fused._common import silu_f32


@triton.jit
def load_x(
    x_rows,  # [M_PAD, 1] row pointers of x
    z_rows,  # [M_PAD, 1] row pointers of z (gated_norm) or the gate (sigmoid_mul)
    nw_ptr,  # [HEAD] norm weight (gated_norm)
    k,  # [BLOCK_K] the tile's input columns
    k_hi,
    K,  # the GEMM's input features (silu_mul: the offset of `up`)
    m_mask,
    eps,
    stride_zh,  # z's head stride: column k of x is z's (k // HEAD, k % HEAD)
    PROLOGUE: tl.constexpr,
    HEAD: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The GEMM's input tile [M_PAD, BLOCK_K] in x's dtype: x[:, k], or the prologue of it
    (zeros past k_hi and past M)."""
    mask = m_mask[:, None] & (k < k_hi)[None, :]
    x = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
    if PROLOGUE == 1:  # silu(gate) * up, silu rounded first (ops/fused/activation.py)
        dtype = x.dtype
        up = tl.load(x_rows + K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        x = (silu_f32(x.to(tl.float32)).to(dtype).to(tl.float32) * up).to(dtype)
    elif PROLOGUE == 2:  # w * rmsnorm(o) * silu(z) per head (ops/fused/gated_norm.py)
        dtype = x.dtype
        z_offs = (k // HEAD) * stride_zh + k % HEAD
        zf = tl.load(z_rows + z_offs[None, :], mask=mask, other=0.0).to(tl.float32)
        xf = tl.reshape(x.to(tl.float32), (M_PAD, BLOCK_K // HEAD, HEAD))
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=2) / HEAD + eps)  # [M_PAD, heads]
        xn = (xf * rstd[:, :, None]).to(dtype).to(tl.float32)
        w = tl.load(nw_ptr + tl.arange(0, HEAD)).to(tl.float32)
        y = tl.reshape((w[None, None, :] * xn).to(dtype).to(tl.float32), (M_PAD, BLOCK_K))
        x = (y * silu_f32(zf)).to(dtype)
    elif PROLOGUE == 3:  # o * sigmoid(gate), sigmoid rounded first (ops/fused/activation.py)
        dtype = x.dtype
        z_offs = (k // HEAD) * stride_zh + k % HEAD
        g = tl.load(z_rows + z_offs[None, :], mask=mask, other=0.0).to(tl.float32)
        sg = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        x = (x.to(tl.float32) * sg).to(dtype)
    return x
