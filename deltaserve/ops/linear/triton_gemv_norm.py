"""Triton decode GEMV with the residual add and RMSNorm before it in the same launch, one row:
`r = h + residual; out = rms_norm(r) @ W.T (+ bias)`, also returning r (the new residual
stream) and, on request, rms_norm(r) itself. bf16 / fp16.

Why: at decode batch 1 every decoder layer runs a residual-add + RMSNorm kernel (ops/fused/
rmsnorm.py, from `add_norm` in layers/decoder.py) whose output feeds one projection (GDN
in_proj, attention qkv, MLA's fused q / kv_a, the MLP's gate_up): two dependent launches per
norm. An earlier fusion into the tensor-core decode GEMM's prologue (triton_norm_gemm.py) ran
1.9-2.7x slower than the two kernels: its weight stream waited on the norm. Here the GEMV
(triton_gemv.py) issues its first two weight chunks before the programmatic-dependent-launch
wait as usual, so at K <= 2 x CHUNK_K all of W is in flight while each program computes the
row's statistics (h and residual are read from L2: a few KB); the weight stream is not delayed.

Numerics are rms_norm's: r rounded to h's dtype, float32 statistics, the normalised row rounded
to the dtype before the weight multiplies it (or `norm * (1 + w)` when zero-centred), the
activation rounded to the dtype before the dot, which then runs as the GEMV's (float32 FMAs per
chunk). The statistics sum chunk by chunk, so rstd may differ from rms_norm's in its last bit.

Each program computes the whole row's statistics itself (no cross-program exchange); program 0
alone writes r and the normalised row, into buffers of their own (the inputs are read by every
program, so nothing is written in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.gdn.triton_conv1d import conv_epilogue
from deltaserve.ops.linear import ConvEpilogue
from deltaserve.ops.linear.triton_gemm import check_decode_gemm_args
from deltaserve.ops.linear.triton_gemv import (
    _load_chunk,
    _prune_chunks,
    conv_launch_args,
    gemv_configs,
    tuned_config,
)


@triton.jit
def _add_chunk(h_ptr, res_ptr, k, K: tl.constexpr):
    """r[k] = h[k] + residual[k] rounded to h's dtype (zeros past K)."""
    m = k < K
    h = tl.load(h_ptr + k, mask=m, other=0.0)
    r = tl.load(res_ptr + k, mask=m, other=0.0)
    return (h.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)


@autotune(configs=gemv_configs(), key=["N", "K"], prune=_prune_chunks)
@triton.jit
def _decode_gemv_norm_kernel(
    h_ptr,  # [K] the block output
    res_ptr,  # [K] the residual stream (read only)
    nw_ptr,  # [K] the norm's weight
    w_ptr,  # [N, K]
    b_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [N]
    res_out_ptr,  # [K] h + residual (written by program 0)
    normed_ptr,  # [K] rms_norm(h + residual) (WRITE_NORMED; program 0)
    N,
    stride_wn,
    eps,
    cw_ptr,  # CONV: as the GEMV's (triton_gemv.py)
    cs_ptr,
    slot_ptr,
    conv_channels,
    stride_cwc,
    stride_cww,
    stride_csn,
    stride_csc,
    stride_csw,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    CONV: tl.constexpr,
    CONV_W: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK_K: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N),): BLOCK_N output columns per program, as the GEMV (and, CONV,
    its conv epilogue)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, CHUNK_K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    # the first two chunks: weights only, so before the wait (ops/pdl.py)
    w_cur = _load_chunk(w_rows, 0, offs_k, n_mask, K)
    w_nxt = _load_chunk(w_rows, CHUNK_K, offs_k, n_mask, K)
    pdl.wait(PDL)
    dtype = h_ptr.dtype.element_ty
    # the row's statistics (every chunk's loads issued together: the loop is unrolled)
    sq = tl.zeros((CHUNK_K,), dtype=tl.float32)
    for k0 in tl.static_range(0, K, CHUNK_K):
        rf = _add_chunk(h_ptr, res_ptr, k0 + offs_k, K).to(tl.float32)
        sq += rf * rf
    rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    first = pid == 0
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, CHUNK_K):
        k = k0 + offs_k
        k_mask = k < K
        r = _add_chunk(h_ptr, res_ptr, k, K)
        nw = tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        xn = r.to(tl.float32) * rstd
        if ZERO_CENTERED:
            y = (xn * (1.0 + nw)).to(dtype)
        else:
            y = (nw * xn.to(dtype).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + k, r, mask=k_mask & first)
        if WRITE_NORMED:
            tl.store(normed_ptr + k, y, mask=k_mask & first)
        acc += tl.sum(w_cur.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)
        # the chunk after next: issued before the next one's math (two in flight)
        w_cur = w_nxt
        w_nxt = _load_chunk(w_rows, k0 + 2 * CHUNK_K, offs_k, n_mask, K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if CONV:
        out = conv_epilogue(
            out, offs_n, n_mask, conv_channels, cw_ptr, cs_ptr, slot_ptr, stride_cwc,
            stride_cww, stride_csn, stride_csc, stride_csw, CONV_W,
        )  # fmt: skip
    tl.store(out_ptr + offs_n, out, mask=n_mask)


def decode_gemv_add_norm(
    h: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    normed_out: torch.Tensor | None = None,
    config: triton.Config | None = None,
    conv: ConvEpilogue | None = None,
) -> torch.Tensor:
    """rms_norm(h + residual) @ weight.T (+ bias) for one row, in one launch.

    Args:
        h, residual: [1, K] contiguous, one dtype (bf16 / fp16); neither is written.
        norm_weight: [K] (h's dtype, or float32 when `zero_centered`, as rms_norm takes it).
        weight: [N, K] (unit last stride); bias: optional [N].
        residual_out: [1, K] receives h + residual (rounded to the dtype); required.
        normed_out: optional [1, K] that receives rms_norm(h + residual).
        config: a fixed configuration instead of the tuner's (tests, benchmarks).
        conv: GDN's conv1d update on the first `conv.channels` columns, as `decode_gemv`'s.

    Returns:
        out [1, N] in h's dtype. `residual_out` holds the new stream.
    """
    M, K, N = check_decode_gemm_args(h, weight, 1)
    buffers = {"residual": residual, "residual_out": residual_out, "normed_out": normed_out}
    for name, t in buffers.items():
        if t is not None and (t.shape != h.shape or t.dtype != h.dtype or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {tuple(h.shape)} {h.dtype} tensor")
    if not h.is_contiguous() or norm_weight.shape != (K,) or not norm_weight.is_contiguous():
        raise ValueError(
            f"h must be contiguous and the norm weight a contiguous [{K}] vector, got "
            f"{tuple(norm_weight.shape)}"
        )
    if residual_out is None:
        raise ValueError("decode_gemv_add_norm needs residual_out (h + residual goes there)")
    out = torch.empty(M, N, dtype=h.dtype, device=h.device)
    if M == 0:
        return out
    kernel, fixed = _decode_gemv_norm_kernel, {}
    if conv is not None and config is None:
        key = ("gemv_norm", N, K, h.dtype, weight.dtype, norm_weight.dtype, bias is not None,
               zero_centered, normed_out is not None, h.device)  # fmt: skip
        config = tuned_config(
            _decode_gemv_norm_kernel, key,
            lambda: decode_gemv_add_norm(
                h, residual, norm_weight, eps, zero_centered, weight, bias,
                residual_out=residual_out, normed_out=normed_out,
            ),
        )  # fmt: skip
    if config is not None:  # the jitted function under the tuner, with this configuration
        kernel, fixed = _decode_gemv_norm_kernel.fn, config.all_kwargs()
    conv_args, conv_consts = conv_launch_args(conv, weight)
    kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
        h, residual, norm_weight, weight, bias if bias is not None else weight, out,
        residual_out, normed_out if normed_out is not None else residual_out,
        N, weight.stride(0), eps, *conv_args, K=K, HAS_BIAS=bias is not None,
        ZERO_CENTERED=zero_centered, WRITE_NORMED=normed_out is not None, **conv_consts,
        **pdl.launch_kwargs(h), **fixed,
    )  # fmt: skip
    return out
