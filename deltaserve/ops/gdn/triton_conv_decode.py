"""The GDN decode step of one token per sequence in one kernel: conv1d update + gated delta rule.

Unfused, a decode step of a GDN layer runs the conv1d update (triton_conv1d.py: silu(conv) of
the in_proj's [q | k | v] columns, the conv window shifted in place) and then the delta rule
(triton_decode.py). Here each program of the delta rule's grid (sequence n, value head h, tile
of BV value rows) computes the conv outputs it reads itself, straight from the in_proj output:
its key head's q and k channels (K each; shared with the other GROUP * NV - 1 programs of that
key head, which compute them too: a few KB from L2) and its own BV value channels. The rounding
points are those of the two kernels (conv output rounded to x's dtype), so the result is theirs
bit for bit, with one launch and no [T, conv_dim] round trip.

The conv windows shift in place:
- the value channels of a tile belong to its program alone, which shifts them once every thread
  of it has read them (a CTA barrier: the tiles are replicated across threads);
- the q and k channels of a key head are read by all its programs: each program, once its reads
  are done (a CTA barrier), counts itself in on the key head's arrival counter
  (ops/tile_counters.py); the last to arrive shifts those windows (every other program has
  read them by then) and resets the counter for the next call or CUDA-graph replay.

One token per sequence (q = 1) and the Triton conv1d and GDN decode backends only: GDNKernels
runs it for all-decode steps when DELTASERVE_GDN_FUSED_CONV=1 (off until measured on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.gdn.triton_decode import decode_tiling, delta_rule_step, state_tile
from deltaserve.ops.tile_counters import arrival_counters


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _conv_channels(
    x_row, w_ptr, s_row, offs_c, mask_c, stride_wc, stride_ww, stride_sc, stride_sw,
    W: tl.constexpr, WP: tl.constexpr,
):  # fmt: skip
    """silu(conv) of channels `offs_c` [BC] of one token, in float32 after rounding to x's dtype
    (as the conv kernel stores it; tap W - 1 times the new input, then taps 0 .. W - 2 times the
    window, in triton_conv1d.py's order), and the channels' next window [BC, WP] (columns
    0 .. W - 2: the window's columns 1 .. W - 2, then the new input) for `_store_window`."""
    x_new = tl.load(x_row + offs_c, mask=mask_c, other=0.0)
    w_ptrs = w_ptr + offs_c * stride_wc
    s_ptrs = s_row + offs_c * stride_sc
    acc = tl.load(w_ptrs + (W - 1) * stride_ww, mask=mask_c, other=0.0).to(tl.float32) * x_new.to(
        tl.float32
    )
    cols = tl.arange(0, WP)[None, :]  # [1, WP]
    nxt = tl.where(cols == W - 2, x_new.to(tl.float32)[:, None], 0.0)  # [BC, WP]
    for j in tl.static_range(W - 1):
        s_j = tl.load(s_ptrs + j * stride_sw, mask=mask_c, other=0.0)
        w_j = tl.load(w_ptrs + j * stride_ww, mask=mask_c, other=0.0).to(tl.float32)
        acc += w_j * s_j.to(tl.float32)
        if j > 0:
            nxt = tl.where(cols == j - 1, s_j.to(tl.float32)[:, None], nxt)
    return _silu(acc).to(x_new.dtype).to(tl.float32), nxt


@triton.jit
def _store_window(
    s_row, offs_c, mask_c, nxt, stride_sc, stride_sw, W: tl.constexpr, WP: tl.constexpr
):
    """The channels' window [BC, W - 1] := nxt (values of the window's dtype, held in float32).
    The caller has made every thread's reads of the old window happen before (a barrier)."""
    cols = tl.arange(0, WP)[None, :]
    ptrs = s_row + offs_c[:, None] * stride_sc + cols * stride_sw
    tl.store(ptrs, nxt.to(s_row.dtype.element_ty), mask=mask_c[:, None] & (cols < W - 1))


@triton.jit
def _gdn_conv_decode_kernel(
    x_ptr,  # [N, >= 2 * HK * K + HV * V] the in_proj output's [q | k | v] columns (raw)
    cw_ptr,  # [conv_dim, W] conv weight
    cs_ptr,  # [num_slots, conv_dim, W - 1] conv windows, shifted in place
    a_ptr,  # [N, HV]
    b_ptr,  # [N, HV]
    A_log_ptr,  # [HV]
    dt_bias_ptr,  # [HV]
    state_ptr,  # [num_slots, HV, V, K] float32 or bfloat16, updated in place
    slots_ptr,  # [N] int64
    cnt_ptr,  # [N * HK] int32 arrival counters, zero between calls
    out_ptr,  # [N, HV, V]
    stride_xn,
    stride_wc,
    stride_ww,
    stride_csn,
    stride_csc,
    stride_csw,
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
    HK: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,  # HV // HK
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,  # next power of two >= W - 1
    PDL: tl.constexpr,
):
    """Grid (N * HV * cdiv(V, BV),), as the delta rule's kernel (triton_decode.py)."""
    pdl.wait(PDL)
    NV: tl.constexpr = (V + BV - 1) // BV
    n, h, hk, slot, offs_k, offs_v, mask_k, mask_v, s_ptrs, mask_s, S = state_tile(
        slots_ptr, state_ptr, stride_sn, stride_sh, stride_sv, stride_sk, HV, GROUP, K, V, BK,
        BV,
    )  # fmt: skip

    # the conv of this program's channels: q and k of key head hk, v of its value rows
    x_row = x_ptr + n * stride_xn
    cs_row = cs_ptr + slot * stride_csn
    q_c = hk * K + offs_k
    k_c = HK * K + hk * K + offs_k
    v_c = 2 * HK * K + h * V + offs_v
    q, q_next = _conv_channels(
        x_row, cw_ptr, cs_row, q_c, mask_k, stride_wc, stride_ww, stride_csc, stride_csw, W, WP
    )
    k, k_next = _conv_channels(
        x_row, cw_ptr, cs_row, k_c, mask_k, stride_wc, stride_ww, stride_csc, stride_csw, W, WP
    )
    v, v_next = _conv_channels(
        x_row, cw_ptr, cs_row, v_c, mask_v, stride_wc, stride_ww, stride_csc, stride_csw, W, WP
    )
    # NOTE: the tiles are smaller than the CTA, so several threads hold one channel: every
    # thread's reads of the windows end before any thread writes one
    tl.debug_barrier()
    _store_window(cs_row, v_c, mask_v, v_next, stride_csc, stride_csw, W, WP)  # ours alone

    # one step of the delta rule (triton_decode.py's)
    a = tl.load(a_ptr + n * stride_an + h * stride_ah)
    b = tl.load(b_ptr + n * stride_bn + h * stride_bh)
    S, o = delta_rule_step(S, q, k, v, a, b, A_log_ptr + h, dt_bias_ptr + h, scale)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_s)
    o_ptrs = out_ptr + n * stride_on + h * stride_oh + offs_v * stride_ov
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_v)

    # the q / k windows of key head hk: written by the last of its programs to have read them
    # (every thread's reads ended at the barrier above, before this single-thread release)
    cnt = cnt_ptr + n * HK + hk
    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if arrived == GROUP * NV - 1:
        _store_window(cs_row, q_c, mask_k, q_next, stride_csc, stride_csw, W, WP)
        _store_window(cs_row, k_c, mask_k, k_next, stride_csc, stride_csw, W, WP)
        tl.atomic_xchg(cnt, 0)  # ready for the next call


def gdn_conv_decode(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
) -> torch.Tensor:
    """One decode token per sequence: the conv1d update and the gated delta rule in one launch,
    in place on both pools (module docstring); equal to `conv1d_decode` then `gdn_decode`.

    Args:
        qkv: [N, 2 * HK * K + HV * V] the in_proj output's raw [q | k | v] columns (any row
            stride, unit last stride).
        conv_weight: [conv_dim, W]; conv_state: [num_slots, conv_dim, W - 1].
        a, b: [N, HV] raw gate inputs. A_log, dt_bias: [HV].
        ssm_state: [num_slots, HV, V, K]; state_slots: [N] int64 (slot 0: padding rows).
        num_k_heads, head_k_dim: HK and K (HV and V come from the state).

    Returns:
        o: [N, HV, V] in qkv's dtype.
    """
    N = state_slots.shape[0]
    hv, v_dim, k_dim = ssm_state.shape[1:]
    hk = num_k_heads
    conv_dim, width = conv_weight.shape
    if k_dim != head_k_dim or hv % hk:
        raise ValueError(f"state {tuple(ssm_state.shape)} does not fit HK={hk}, K={head_k_dim}")
    if conv_dim != 2 * hk * k_dim + hv * v_dim or qkv.shape[1] < conv_dim:
        raise ValueError(f"conv_dim {conv_dim} is not 2 * HK * K + HV * V for these heads")
    if qkv.shape[0] != N or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} must be [N={N}, >= {conv_dim}], unit stride")
    if conv_state.shape[1:] != (conv_dim, width - 1):
        raise ValueError(f"conv_state {tuple(conv_state.shape)} does not fit the conv weight")
    out = torch.empty(N, hv, v_dim, dtype=qkv.dtype, device=qkv.device)
    if N == 0:
        return out
    block_v, num_warps = decode_tiling(v_dim, k_dim)
    counters = arrival_counters("gdn-conv-decode", conv_weight, triton.next_power_of_2(N) * hk)
    grid = (N * hv * triton.cdiv(v_dim, block_v),)
    _gdn_conv_decode_kernel[grid](
        qkv, conv_weight, conv_state, a, b, A_log, dt_bias, ssm_state, state_slots, counters,
        out, qkv.stride(0), *conv_weight.stride(), *conv_state.stride(), *a.stride(),
        *b.stride(), *ssm_state.stride(), *out.stride(), k_dim**-0.5, HK=hk, HV=hv,
        GROUP=hv // hk, K=k_dim, V=v_dim, BK=triton.next_power_of_2(k_dim), BV=block_v, W=width,
        WP=triton.next_power_of_2(width - 1), num_warps=num_warps, **pdl.launch_kwargs(qkv),
    )  # fmt: skip
    return out
