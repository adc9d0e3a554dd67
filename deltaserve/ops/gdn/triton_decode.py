"""Triton Gated-DeltaNet decode: one fused kernel per layer call, in place on the state pool.

One program handles one (sequence n, value head h, tile of BV value rows). It reads the state
tile `S[state_slots[n], h, v0:v0 + BV, :]` ([BV, K], "K-last") straight from the pool, takes
the gated delta rule in float32 (math in `deltaserve.ops.gdn`) through the sequence's q tokens
(rows n * q .. n * q + q - 1) with the tile in registers, and writes it back where it was once:
no gather / scatter copies, no host reads (CUDA-graph safe). q is a compile-time constant and
its loop is unrolled, so q = 1 compiles to the one-step kernel.

The decode step is bound by the state bytes (read + written once); narrow V tiles keep the GPU
busy at batch 1 (HV=32, V=128, BV=8: 512 programs), and consecutive programs stream one head's
contiguous [V, K] block.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.fused.gated_norm import gated_norm_rows
from deltaserve.ops.gdn import GDNDecodeBackend, OutputNorm
from deltaserve.ops.tile_counters import arrival_counters


@triton.jit
def _gdn_decode_kernel(
    q_ptr,  # [N * QLEN, HK, K]
    k_ptr,  # [N * QLEN, HK, K]
    v_ptr,  # [N * QLEN, HV, V]
    a_ptr,  # [N * QLEN, HV] raw decay input
    b_ptr,  # [N * QLEN, HV] raw beta input
    A_log_ptr,  # [HV]
    dt_bias_ptr,  # [HV]
    state_ptr,  # [num_slots, HV, V, K], float32 or bfloat16, updated in place
    slots_ptr,  # [N] int64
    out_ptr,  # [N * QLEN, HV, V]
    stride_qn,
    stride_qh,
    stride_qk,
    stride_kn,
    stride_kh,
    stride_kk,
    stride_vn,
    stride_vh,
    stride_vv,
    stride_an,
    stride_ah,
    stride_bn,
    stride_bh,
    stride_sn,
    stride_sh,
    stride_sv,
    stride_sk,
    stride_on,
    stride_oh,
    stride_ov,
    scale,  # K ** -0.5
    z_ptr,  # NORM: [N, HV, V] the output gate
    stride_zn,
    stride_zh,
    nw_ptr,  # NORM: [V] the output norm's weight
    cnt_ptr,  # NORM: [N * HV] int32 arrival counters (ops/tile_counters.py), 0 between calls
    eps,  # NORM: the output norm's epsilon
    HV: tl.constexpr,
    GROUP: tl.constexpr,  # HV // HK: value heads per key head
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,  # next power of two >= K: the whole key dim in one tile
    BV: tl.constexpr,
    QLEN: tl.constexpr,  # tokens per sequence, carried through the state in order
    QLEN_PAD: tl.constexpr,  # next power of two >= QLEN
    NORM: tl.constexpr,  # QLEN 1: the output norm in this launch (`_gated_norm_last`)
    VP: tl.constexpr,  # next power of two >= V
    PDL: tl.constexpr,
):
    """Grid (N * HV * cdiv(V, BV),). QLEN gated-delta-rule steps for a [BV, K] state tile.

    Consecutive programs take consecutive V tiles of one (sequence, head), so together they
    stream its contiguous [V, K] state block. With QLEN > 1 the outputs are gathered in
    registers and stored once after the last token: a store inside the token loop would keep
    the next token's loads behind it (they may alias), exposing a load latency per token.
    """
    pdl.wait(PDL)
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    pid_v = pid % NV
    pid_nh = pid // NV
    n = pid_nh // HV
    h = pid_nh % HV
    hk = h // GROUP

    offs_k = tl.arange(0, BK)  # [BK]
    offs_v = pid_v * BV + tl.arange(0, BV)  # [BV]
    mask_k = offs_k < K
    mask_v = offs_v < V

    # the state tile first: it is what this kernel waits on
    slot = tl.load(slots_ptr + n).to(tl.int64)
    s_ptrs = (
        state_ptr
        + slot * stride_sn
        + h * stride_sh
        + offs_v[:, None] * stride_sv
        + offs_k[None, :] * stride_sk
    )  # [BV, BK]
    mask_s = mask_v[:, None] & mask_k[None, :]
    S = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)
    offs_t = tl.arange(0, QLEN_PAD)  # [QLEN_PAD]
    outs = tl.zeros((QLEN_PAD, BV), dtype=tl.float32)  # the outputs of QLEN > 1 tokens

    for t in tl.static_range(QLEN):
        row = n * QLEN + t  # token row of the sequence's t-th token
        q = tl.load(
            q_ptr + row * stride_qn + hk * stride_qh + offs_k * stride_qk, mask=mask_k, other=0.0
        )
        k = tl.load(
            k_ptr + row * stride_kn + hk * stride_kh + offs_k * stride_kk, mask=mask_k, other=0.0
        )
        v = tl.load(
            v_ptr + row * stride_vn + h * stride_vh + offs_v * stride_vv, mask=mask_v, other=0.0
        )
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        # L2 norm over K (eps inside the rsqrt, as the reference); the scale folds into q
        q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)

        # gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
        a = tl.load(a_ptr + row * stride_an + h * stride_ah).to(tl.float32)
        b = tl.load(b_ptr + row * stride_bn + h * stride_bh).to(tl.float32)
        x = a + tl.load(dt_bias_ptr + h).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32)) * softplus
        beta = 1.0 / (1.0 + tl.exp(-b))

        # S = exp(g) S;  S += beta (v - S k) k^T;  o = S q
        S = S * tl.exp(g)
        predicted = tl.sum(S * k[None, :], axis=1)  # [BV]
        delta = beta * (v - predicted)  # [BV]
        S = S + delta[:, None] * k[None, :]
        o = tl.sum(S * q[None, :], axis=1)  # [BV]

        if t == QLEN - 1:  # NOTE: the state is stored once, after the last token
            tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_s)
        if QLEN == 1:
            o_ptrs = out_ptr + row * stride_on + h * stride_oh + offs_v * stride_ov
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_v)
            if NORM:
                _gated_norm_last(
                    out_ptr + row * stride_on + h * stride_oh, stride_ov,
                    z_ptr + row * stride_zn + h * stride_zh, nw_ptr, cnt_ptr + row * HV + h,
                    eps, V, VP, NV,
                )  # fmt: skip
        else:
            outs = tl.where(offs_t[:, None] == t, o[None, :], outs)

    if QLEN > 1:
        rows_t = (n * QLEN + offs_t).to(tl.int64)  # [QLEN_PAD] the sequence's token rows
        o_ptrs = (
            out_ptr + rows_t[:, None] * stride_on + h * stride_oh + offs_v[None, :] * stride_ov
        )  # [QLEN_PAD, BV]
        mask_o = (offs_t < QLEN)[:, None] & mask_v[None, :]
        tl.store(o_ptrs, outs.to(out_ptr.dtype.element_ty), mask=mask_o)


@triton.jit
def _gated_norm_last(o_row, stride_ov, z_row, nw_ptr, cnt, eps, V: tl.constexpr,
                     VP: tl.constexpr, NV: tl.constexpr):  # fmt: skip
    """After a program stored its V tile of one (token, head): the last of the head's NV
    programs to arrive reads the whole head's output back (from L2, `.cg`), applies the output
    norm `w * norm(o) * silu(z)` (ops/fused/gated_norm.py's math) in place and sets the
    head's counter back to 0 (ops/tile_counters.py)."""
    tl.debug_barrier()  # every thread's part stored before the (single-thread) release
    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if arrived == NV - 1:
        offs = tl.arange(0, VP)[None, :]  # [1, VP]: one row for gated_norm_rows
        m = offs < V
        dtype = o_row.dtype.element_ty
        xf = tl.load(o_row + offs * stride_ov, mask=m, other=0.0, cache_modifier=".cg")
        zf = tl.load(z_row + offs, mask=m, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + offs, mask=m, other=0.0).to(tl.float32)
        y = gated_norm_rows(xf.to(tl.float32), zf, w, V, eps, dtype)
        tl.store(o_row + offs * stride_ov, y.to(dtype), mask=m)
        tl.atomic_xchg(cnt, 0)  # ready for the next call


def decode_tiling(head_v_dim: int, head_k_dim: int) -> tuple[int, int]:
    """(BV, num_warps) by shape, fixed (no autotuning, so CUDA-graph capture sees no benchmarking).

    Measured on an H200 (HV=32, K=V=128, fp32 state, in a CUDA graph, cold L2): BV=8 with 2
    warps (16 state values per thread) was best or within noise of best at every batch size:
    3.5 us at B=1, 139 us at B=128 (3.9 TB/s), 538 us at B=512 (4.0 TB/s). Wider tiles or more
    warps lose 2-10% at large batch.
    """
    block_k = triton.next_power_of_2(head_k_dim)
    if os.environ.get("TRITON_INTERPRET") == "1":  # CPU interpreter: fewest programs is fastest
        return triton.next_power_of_2(head_v_dim), 4
    block_v = min(8, triton.next_power_of_2(head_v_dim))
    num_warps = max(1, min(4, block_v * block_k // 512))
    return block_v, num_warps


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    block_v: int | None = None,
    num_warps: int | None = None,
    query_len: int = 1,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """The gated delta rule over `query_len` tokens per sequence, in place on `ssm_state`
    (exactly as feeding the tokens one call at a time, but the state is read and written once).

    Args:
        q, k: [N * query_len, HK, K] raw (un-normalised) queries and keys; any strides.
            Sequence n owns rows n * query_len .. n * query_len + query_len - 1.
        v: [N * query_len, HV, V]. a, b: [N * query_len, HV] raw gate inputs.
        A_log, dt_bias: [HV].
        ssm_state: [num_slots, HV, V, K] float32 or bfloat16 pool, updated for `state_slots`.
        state_slots: [N] int64 pool slot per sequence (slot 0: the null slot of padding rows).
        block_v, num_warps: override the tiling heuristic (benchmarks).
        query_len: q, the tokens of every sequence (a compile-time constant of the kernel).
        norm: (z [N, HV, V] with unit last stride, weight [V], eps) at query_len 1: the
            layer's output norm `w * norm(o) * silu(z)` per head in the same launch (the
            last of a head's programs applies it), as ops/fused's gated_rms_norm computes it.

    Returns:
        o: [N * query_len, HV, V] in v's dtype (normed and gated with `norm`).
    """
    rows, num_k_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    N = state_slots.shape[0]
    assert query_len >= 1 and rows == N * query_len, (rows, N, query_len)
    assert k.shape == q.shape and v.shape[0] == rows and state_slots.shape == (N,)
    assert num_v_heads % num_k_heads == 0, f"HV={num_v_heads} not a multiple of HK={num_k_heads}"
    assert ssm_state.shape[1:] == (num_v_heads, head_v_dim, head_k_dim), ssm_state.shape
    out = torch.empty(rows, num_v_heads, head_v_dim, dtype=v.dtype, device=v.device)
    if N == 0:
        return out
    heur_v, heur_warps = decode_tiling(head_v_dim, head_k_dim)
    block_v = block_v or heur_v
    num_warps = num_warps or heur_warps
    grid = (N * num_v_heads * triton.cdiv(head_v_dim, block_v),)
    z, norm_weight, eps, counters = v, A_log, 0.0, state_slots  # placeholders without `norm`
    if norm is not None:
        z, norm_weight, eps = norm
        if query_len != 1 or z.shape != v.shape or z.stride(-1) != 1:
            raise ValueError(
                f"the fused output norm takes one token per sequence and a gate z shaped as v "
                f"{tuple(v.shape)} with unit last stride, got query_len {query_len}, z "
                f"{tuple(z.shape)} strides {z.stride()}"
            )
        if norm_weight.shape != (head_v_dim,):
            raise ValueError(f"the output norm's weight must be [{head_v_dim}]")
        counters = arrival_counters("gdn-decode-norm", A_log, N * num_v_heads)
    _gdn_decode_kernel[grid](
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        ssm_state,
        state_slots,
        out,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *a.stride(),
        *b.stride(),
        *ssm_state.stride(),
        *out.stride(),
        head_k_dim**-0.5,
        z,
        z.stride(0),
        z.stride(1),
        norm_weight,
        counters,
        eps,
        HV=num_v_heads,
        GROUP=num_v_heads // num_k_heads,
        K=head_k_dim,
        V=head_v_dim,
        BK=triton.next_power_of_2(head_k_dim),
        BV=block_v,
        QLEN=query_len,
        QLEN_PAD=triton.next_power_of_2(query_len),
        NORM=norm is not None,
        VP=triton.next_power_of_2(head_v_dim),
        num_warps=num_warps,
        **pdl.launch_kwargs(q),
    )
    return out


class TritonGDNDecode(GDNDecodeBackend):
    """The fused Triton decode (`gdn_decode`): one launch per layer, q tokens per sequence,
    no host reads."""

    name = "triton"
    supports_cuda_graph = True

    def __init__(self) -> None:
        from deltaserve import env

        self.gated_norm = env.gdn_decode_norm() == "fused"  # read once, at start-up

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_state: torch.Tensor,
        state_slots: torch.Tensor,
        query_len: int = 1,
        norm: OutputNorm | None = None,
    ) -> torch.Tensor:
        return gdn_decode(
            q, k, v, a, b, A_log, dt_bias, ssm_state, state_slots, query_len=query_len,
            norm=norm,
        )  # fmt: skip

    def fuses_gated_norm(self) -> bool:
        """DELTASERVE_GDN_DECODE_NORM=fused (off by default: level at batch 1 on an H200)."""
        return self.gated_norm
