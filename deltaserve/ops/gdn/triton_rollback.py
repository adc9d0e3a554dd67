"""Fused Triton GDN rollback of one layer after a speculative verify step.

`rollback_layer` in spec/gdn_rollback.py is the torch reference: from the verify step's records
(per token: the conv input [q | k | v], then b, then a, model dtype) and the pre-verify states
in a scratch slot it recomputes the conv outputs, keys, gates and replays the SSM recurrence
over the kept tokens, then re-selects the conv state. Here the same math runs in two launches
per layer, with no intermediate tensors:

- `_rollback_replay_kernel`, one program per (rollback row, value head, tile of BV value rows):
  the causal conv of this head's K key channels and BV value channels over
  [pre-verify conv state | recorded inputs] (float32, SiLU, cast to the record dtype as the
  forward does), the l2norm of the key, the gates g, beta from a, b, A_log, dt_bias, and the
  gated delta rule from ssm_state[src] over the row's kept tokens, stored to ssm_state[dst];
- `_rollback_conv_kernel`, one program per (rollback row, tile of channels): the new conv state,
  the last W - 1 inputs of [pre-verify conv state | the kept inputs], stored to conv_state[dst].

Rows are described by device tensors (record row, kept, src, dst), read on the device, so the
launches can be captured in a CUDA graph. A row with kept == 0 is SKIPPED (its slots are left
as they are): padding rows and rows that kept all their tokens carry kept = 0 in a graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops.gdn.triton_decode import decode_tiling


@triton.jit
def _conv_input(
    rec_ptr,  # [rows * Q, D] records
    conv_ptr,  # [num_slots, C, W - 1] conv state pool
    rec_base,  # offset of the row's token 0
    conv_base,  # offset of conv_state[src]
    idx,  # position in xpad = [old (W - 1) | inputs (Q)]
    chan,  # [BC] channel offsets
    mask,  # [BC]
    stride_rt,
    stride_cc,
    W: tl.constexpr,
):
    """xpad[idx, chan] in float32: the pre-verify conv state below W - 1, a record above."""
    from_old = idx < W - 1
    old = tl.load(
        conv_ptr + conv_base + chan * stride_cc + idx, mask=mask & from_old, other=0.0
    ).to(tl.float32)
    new = tl.load(
        rec_ptr + rec_base + (idx - (W - 1)) * stride_rt + chan,
        mask=mask & (idx >= W - 1),
        other=0.0,
    ).to(tl.float32)
    return tl.where(from_old, old, new)


@triton.jit
def _conv_silu(
    rec_ptr,
    conv_ptr,
    w_ptr,  # [C, W] conv weight
    rec_base,
    conv_base,
    t,  # token position
    chan,
    mask,
    stride_rt,
    stride_cc,
    stride_wc,
    W: tl.constexpr,
):
    """silu(sum_j w[c, j] * xpad[t + j, c]) in float32, rounded to the record dtype."""
    acc = tl.zeros(chan.shape, dtype=tl.float32)
    for j in tl.static_range(W):
        w = tl.load(w_ptr + chan * stride_wc + j, mask=mask, other=0.0).to(tl.float32)
        x = _conv_input(
            rec_ptr, conv_ptr, rec_base, conv_base, t + j, chan, mask, stride_rt, stride_cc, W
        )
        acc += w * x
    out = acc / (1.0 + tl.exp(-acc))
    return out.to(rec_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _rollback_replay_kernel(
    rec_ptr,  # [rows * Q, C + 2 HV] conv input, b, a per token (model dtype)
    w_ptr,  # [C, W] conv weight
    a_log_ptr,  # [HV]
    dt_bias_ptr,  # [HV]
    record_row_ptr,  # [R] int64
    kept_ptr,  # [R] int64, 0 = skip the row
    src_ptr,  # [R] int64 scratch slots
    dst_ptr,  # [R] int64 the sequences' slots
    conv_ptr,  # [num_slots, C, W - 1]
    state_ptr,  # [num_slots, HV, V, K]
    stride_rt,
    stride_cn,
    stride_cc,
    stride_wc,
    stride_sn,
    stride_sh,
    stride_sv,
    Q: tl.constexpr,
    C: tl.constexpr,
    W: tl.constexpr,
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Grid (R * HV * cdiv(V, BV),): program (row i, head h, value tile)."""
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    pid_v = pid % NV
    h = (pid // NV) % HV
    i = pid // (NV * HV)
    n = tl.load(kept_ptr + i).to(tl.int32)
    active = n > 0
    rec_base = tl.load(record_row_ptr + i).to(tl.int64) * Q * stride_rt
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    conv_base = src * stride_cn

    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k = (offs_k < K) & active
    mask_v = (offs_v < V) & active
    mask_s = mask_v[:, None] & mask_k[None, :]
    # this head's channels in [q | k | v]: key head h // (HV / HK), value head h
    chan_k = HK * K + (h // (HV // HK)) * K + offs_k
    chan_v = 2 * HK * K + h * V + offs_v
    A = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)

    tile = h * stride_sh + offs_v[:, None] * stride_sv + offs_k[None, :]  # [BV, BK]
    S = tl.load(state_ptr + src * stride_sn + tile, mask=mask_s, other=0.0).to(tl.float32)
    # NOTE: a fixed trip count whose steps past n are skipped by a branch (as in
    # triton_replay.py): on the GPU they load and compute nothing
    for t in range(0, Q):
        if t < n:
            k = _conv_silu(
                rec_ptr, conv_ptr, w_ptr, rec_base, conv_base, t, chan_k, mask_k,
                stride_rt, stride_cc, stride_wc, W,
            )  # fmt: skip
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            v = _conv_silu(
                rec_ptr, conv_ptr, w_ptr, rec_base, conv_base, t, chan_v, mask_v,
                stride_rt, stride_cc, stride_wc, W,
            )  # fmt: skip
            tok = rec_ptr + rec_base + t * stride_rt
            b = tl.load(tok + C + h, mask=active, other=0.0).to(tl.float32)
            a = tl.load(tok + C + HV + h, mask=active, other=0.0).to(tl.float32) + dt_bias
            softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
            g = A * softplus
            beta = 1.0 / (1.0 + tl.exp(-b))
            S = S * tl.exp(g)
            predicted = tl.sum(S * k[None, :], axis=1)  # [BV]
            S = S + (beta * (v - predicted))[:, None] * k[None, :]
    tl.store(state_ptr + dst * stride_sn + tile, S.to(state_ptr.dtype.element_ty), mask=mask_s)


@triton.jit
def _rollback_conv_kernel(
    rec_ptr,
    record_row_ptr,
    kept_ptr,
    src_ptr,
    dst_ptr,
    conv_ptr,  # [num_slots, C, W - 1]
    stride_rt,
    stride_cn,
    stride_cc,
    Q: tl.constexpr,
    C: tl.constexpr,
    W: tl.constexpr,
    BC: tl.constexpr,
):
    """Grid (R, cdiv(C, BC)): conv_state[dst, c, j] = xpad[n + j, c], j < W - 1."""
    i = tl.program_id(0).to(tl.int64)
    chan = tl.program_id(1) * BC + tl.arange(0, BC)
    n = tl.load(kept_ptr + i).to(tl.int32)
    mask = (chan < C) & (n > 0)
    rec_base = tl.load(record_row_ptr + i).to(tl.int64) * Q * stride_rt
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    for j in tl.static_range(W - 1):
        x = _conv_input(
            rec_ptr, conv_ptr, rec_base, src * stride_cn, n + j, chan, mask,
            stride_rt, stride_cc, W,
        )  # fmt: skip
        tl.store(
            conv_ptr + dst * stride_cn + chan * stride_cc + j,
            x.to(conv_ptr.dtype.element_ty),
            mask=mask,
        )


def gdn_rollback_fused(
    records: torch.Tensor,  # [rows * Q, C + 2 HV]
    conv_weight: torch.Tensor,  # [C, W]
    A_log: torch.Tensor,  # [HV]
    dt_bias: torch.Tensor,  # [HV]
    record_rows: torch.Tensor,  # [R] int64
    kept: torch.Tensor,  # [R] int64 in 0 .. Q (0: skip)
    src_slots: torch.Tensor,  # [R] int64
    dst_slots: torch.Tensor,  # [R] int64
    conv_state: torch.Tensor,  # [num_slots, C, W - 1]
    ssm_state: torch.Tensor,  # [num_slots, HV, V, K]
    query_len: int,
    num_k_heads: int,
) -> None:
    """One GDN layer's rollback (the module docstring): for each row i with kept[i] > 0, the
    conv and SSM state of slot dst[i] become those after the first kept[i] recorded tokens of
    record row record_rows[i], from the pre-verify states in slot src[i]. No dst may be a src."""
    Q, HK = query_len, num_k_heads
    _, HV, V, K = ssm_state.shape
    C, W = conv_weight.shape
    R = kept.shape[0]
    if records.shape[-1] != C + 2 * HV or records.shape[0] % Q:
        raise ValueError(f"records {tuple(records.shape)} for C={C}, HV={HV}, Q={Q}")
    if conv_state.shape[1:] != (C, W - 1) or C != 2 * HK * K + HV * V or HV % HK:
        raise ValueError(
            f"conv state {tuple(conv_state.shape)} / conv_dim {C} do not fit HK={HK}, HV={HV}, "
            f"K={K}, V={V}, W={W}"
        )
    for name, t in (("records", records), ("conv_weight", conv_weight), ("ssm", ssm_state)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be unit-stride in its last dim")
    if conv_state.stride(-1) != 1:
        raise ValueError("conv_state must be unit-stride in its last dim")
    if R == 0:
        return
    block_v, num_warps = decode_tiling(V, K)
    grid = (R * HV * triton.cdiv(V, block_v),)
    _rollback_replay_kernel[grid](
        records, conv_weight, A_log, dt_bias, record_rows, kept, src_slots, dst_slots,
        conv_state, ssm_state,
        records.stride(0), conv_state.stride(0), conv_state.stride(1), conv_weight.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        Q=Q, C=C, W=W, HK=HK, HV=HV, K=K, V=V,
        BK=triton.next_power_of_2(K), BV=block_v, num_warps=num_warps,
    )  # fmt: skip
    block_c = min(1024, triton.next_power_of_2(C))
    _rollback_conv_kernel[(R, triton.cdiv(C, block_c))](
        records, record_rows, kept, src_slots, dst_slots, conv_state,
        records.stride(0), conv_state.stride(0), conv_state.stride(1),
        Q=Q, C=C, W=W, BC=block_c, num_warps=4,
    )  # fmt: skip
