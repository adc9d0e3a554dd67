"""Triton GDN state replay (ops/gdn/replay.py states the contract).

One program handles one (row r, value head h, tile of BV value rows): it loads the state tile
from slot src[r], carries it in float32 through the row's first num_kept[r] tokens (read on the
device: no host reads, capturable) and stores it to slot dst[r].
Like the decode kernel, it is bound by the state bytes (read once, written once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops.gdn.replay import GDNReplayBackend
from deltaserve.ops.gdn.triton_decode import decode_tiling


@triton.jit
def _gdn_replay_kernel(
    k_ptr,  # [R, Q, HV, K] float32, normalised
    v_ptr,  # [R, Q, HV, V]
    g_ptr,  # [R, Q, HV] float32
    beta_ptr,  # [R, Q, HV] float32
    num_kept_ptr,  # [R] int64
    src_ptr,  # [R] int64
    dst_ptr,  # [R] int64
    state_ptr,  # [num_slots, HV, V, K]
    stride_kr,
    stride_kq,
    stride_kh,
    stride_vr,
    stride_vq,
    stride_vh,
    stride_gr,
    stride_gq,
    stride_br,
    stride_bq,
    stride_sn,
    stride_sh,
    stride_sv,
    Q: tl.constexpr,  # token positions per row
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Grid (R * HV * cdiv(V, BV),). K and V are the innermost (unit-stride) dims."""
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    pid_v = pid % NV
    pid_rh = pid // NV
    r = pid_rh // HV
    h = pid_rh % HV

    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_s = mask_v[:, None] & mask_k[None, :]

    src = tl.load(src_ptr + r).to(tl.int64)
    dst = tl.load(dst_ptr + r).to(tl.int64)
    n = tl.load(num_kept_ptr + r).to(tl.int32)
    tile = h * stride_sh + offs_v[:, None] * stride_sv + offs_k[None, :]  # [BV, BK]
    S = tl.load(state_ptr + src * stride_sn + tile, mask=mask_s, other=0.0).to(tl.float32)
    # NOTE: a fixed trip count (the interpreter cannot loop to a loaded bound) whose steps past
    # n are skipped by a branch: on the GPU they load and compute nothing
    for t in range(0, Q):
        if t < n:
            k = tl.load(
                k_ptr + r * stride_kr + t * stride_kq + h * stride_kh + offs_k,
                mask=mask_k,
                other=0.0,
            ).to(tl.float32)
            v = tl.load(
                v_ptr + r * stride_vr + t * stride_vq + h * stride_vh + offs_v,
                mask=mask_v,
                other=0.0,
            ).to(tl.float32)
            g = tl.load(g_ptr + r * stride_gr + t * stride_gq + h).to(tl.float32)
            beta = tl.load(beta_ptr + r * stride_br + t * stride_bq + h).to(tl.float32)
            S = S * tl.exp(g)
            predicted = tl.sum(S * k[None, :], axis=1)  # [BV]
            S = S + (beta * (v - predicted))[:, None] * k[None, :]
    tl.store(state_ptr + dst * stride_sn + tile, S.to(state_ptr.dtype.element_ty), mask=mask_s)


def gdn_replay(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_kept: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    ssm_state: torch.Tensor,
) -> None:
    """ssm_state[dst[r]] = the state after tokens 0 .. num_kept[r] - 1 of row r, replayed from
    ssm_state[src[r]] (shapes in ops/gdn/replay.py)."""
    R, Q, HV, K = k.shape
    V = v.shape[-1]
    assert v.shape[:3] == (R, Q, HV) and g.shape == (R, Q, HV) and beta.shape == (R, Q, HV)
    assert ssm_state.shape[1:] == (HV, V, K), ssm_state.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and ssm_state.stride(-1) == 1
    assert g.stride(-1) == 1 and beta.stride(-1) == 1
    if R == 0:
        return
    block_v, num_warps = decode_tiling(V, K)
    grid = (R * HV * triton.cdiv(V, block_v),)
    _gdn_replay_kernel[grid](
        k,
        v,
        g,
        beta,
        num_kept,
        src_slots,
        dst_slots,
        ssm_state,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        ssm_state.stride(0),
        ssm_state.stride(1),
        ssm_state.stride(2),
        Q=Q,
        HV=HV,
        K=K,
        V=V,
        BK=triton.next_power_of_2(K),
        BV=block_v,
        num_warps=num_warps,
    )


class TritonGDNReplay(GDNReplayBackend):
    """The Triton replay kernel (`gdn_replay`)."""

    name = "triton"
    supports_cuda_graph = True
    supports_fused_rollback = True

    def forward(self, k, v, g, beta, num_kept, src_slots, dst_slots, ssm_state) -> None:
        gdn_replay(k, v, g, beta, num_kept, src_slots, dst_slots, ssm_state)

    def rollback_layer(self, *args, **kwargs) -> None:
        """One GDN layer's fused rollback (`gdn_rollback_fused`'s arguments)."""
        from deltaserve.ops.gdn.triton_rollback import gdn_rollback_fused

        gdn_rollback_fused(*args, **kwargs)
