"""Triton GDN prefill for short rows: the gated delta rule token by token, ONE launch per call.

One program handles one (sequence n, value head h, tile of BV value rows). It reads the state
tile `S[slot[n], h, v0:v0 + BV, :]` ([BV, K], "K-last") from the pool (zeros, with the pool
never read, when the sequence has no initial state: a fresh slot may hold garbage, even NaN),
carries it in registers in float32 through the sequence's tokens `start[n] .. end[n] - 1`
(the math of `deltaserve.ops.gdn`, exactly the reference's: l2-normalised q and k with eps
1e-6 inside the rsqrt, q scaled by K ** -0.5, g = -exp(A_log) * softplus(a + dt_bias),
beta = sigmoid(b)), writes each token's output [BV] and stores the tile back once, in the
pool's dtype.

Why it exists: fla's chunked kernels cost ~1.6 ms of host time per layer call (8 launches
through its autotuner / wrapper stack), far more than the device work of a chat turn's
~170-token rows. This kernel is one plain launch (tiling fixed per shape, no autotuning), so a
step of short rows is bound by the device, not the host; its work is sequential in the tokens,
so it is slow for long rows (deltaserve.ops.gdn.row_split sends only short rows here when the
`fla` backend is chosen; the `triton` backend sends every row).

The token loop is latency-bound: the next token's q, k, v, a and b are loaded one iteration
ahead (in registers), so their load latency hides behind the current token's math. Sequences
are given by (start, end) token rows, so a subset of a batch's sequences runs in place, on the
batch's own q / k / v / out rows, without gathers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deltaserve.forward_context import PrefillMetadata
from deltaserve.ops.gdn import GDNPrefillBackend

MAX_HEAD_DIM = 256  # K and V: one [BV, next_pow2(K)] tile in registers per program
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STATE_DTYPES = (torch.float32, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _load_token(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    row,  # int64 token row
    valid,  # int1: False past the sequence's end (everything masked)
    hk,
    h,
    offs_k,
    offs_v,
    mask_k,
    mask_v,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_an,
    stride_ah,
    stride_bn,
    stride_bh,
):
    """q, k (the shape of offs_k: [BK] or [1, BK]), v [BV] and the raw gate inputs a, b of one
    token, in their dtypes."""
    q = tl.load(q_ptr + row * stride_qn + hk * stride_qh + offs_k, mask=mask_k & valid, other=0.0)
    k = tl.load(k_ptr + row * stride_kn + hk * stride_kh + offs_k, mask=mask_k & valid, other=0.0)
    v = tl.load(v_ptr + row * stride_vn + h * stride_vh + offs_v, mask=mask_v & valid, other=0.0)
    a = tl.load(a_ptr + row * stride_an + h * stride_ah, mask=valid, other=0.0)
    b = tl.load(b_ptr + row * stride_bn + h * stride_bh, mask=valid, other=0.0)
    # NOTE: returned as loaded (converted where used, a token later): a conversion here would
    # make the warp wait for the prefetch it has just issued
    return q, k, v, a, b


@triton.jit
def _delta_step(S, q, k, v, a, b, neg_A, dt_bias, scale, ROW_QK: tl.constexpr):
    """One token of the gated delta rule on a [BV, BK] float32 tile: (o [BV], new S). q, k are
    [1, BK] rows when ROW_QK, else [BK] vectors (any float dtype: the math is float32)."""
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    a = a.to(tl.float32)
    b = b.to(tl.float32)
    # L2 norm over K (eps inside the rsqrt, as the reference); the scale folds into q
    if not ROW_QK:  # [BK] -> [1, BK] first: the sums below then stay inside each warp
        q = q[None, :]
        k = k[None, :]
    q = q * (tl.rsqrt(tl.sum(q * q, axis=1, keep_dims=True) + 1e-6) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, axis=1, keep_dims=True) + 1e-6)
    # g = -exp(A_log) * softplus(a + dt_bias) (softplus linear past 20, as torch's), beta
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = neg_A * softplus
    beta = 1.0 / (1.0 + tl.exp(-b))
    # S = exp(g) S;  S += beta (v - S k) k^T;  o = S q
    S = S * tl.exp(g)
    predicted = tl.sum(S * k, axis=1)  # [BV]
    S = S + (beta * (v - predicted))[:, None] * k
    o = tl.sum(S * q, axis=1)  # [BV]
    return o, S


@triton.jit
def _gdn_prefill_kernel(
    q_ptr,  # [T, HK, K], last dim unit stride
    k_ptr,  # [T, HK, K]
    v_ptr,  # [T, HV, V]
    a_ptr,  # [T, HV] raw decay input
    b_ptr,  # [T, HV] raw beta input
    A_log_ptr,  # [HV]
    dt_bias_ptr,  # [HV]
    state_ptr,  # [num_slots, HV, V, K], float32 or bfloat16, updated in place
    starts_ptr,  # [N] first token row of each sequence
    ends_ptr,  # [N] one past its last token row
    slots_ptr,  # [N] int64 pool slot
    init_ptr,  # [N] bool: read the slot's state (else start from zeros)
    out_ptr,  # [T, HV, V], last dim unit stride
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_an,
    stride_ah,
    stride_bn,
    stride_bh,
    stride_sn,
    stride_sh,
    stride_sv,
    stride_on,
    stride_oh,
    scale,  # K ** -0.5
    HV: tl.constexpr,
    GROUP: tl.constexpr,  # HV // HK: value heads per key head
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,  # next power of two >= K: the whole key dim in one tile
    BV: tl.constexpr,
    ROW_QK: tl.constexpr,  # load q and k as [1, BK] rows (one warp) or [BK] vectors
    INTERPRET: tl.constexpr,
):
    """Grid (N * HV * cdiv(V, BV),): one sequence's tokens through a [BV, K] state tile.

    NOTE on layouts (read from the compiled TTGIR for sm_90): the state tile's layout puts K
    across one warp's lanes and the warps along V, so its reductions over K stay inside a warp.
    With one warp, q and k loaded as [1, BK] rows take that same layout: no layout conversion in
    the loop. With more warps a [1, BK] load would spread K over the warps (and pull the tile
    with it), so q and k are loaded as [BK] vectors and converted (through shared memory).
    """
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
    mask_s = mask_v[:, None] & mask_k[None, :]
    if ROW_QK:  # q and k as [1, BK] rows
        offs_qk = offs_k[None, :]
        mask_qk = mask_k[None, :]
    else:
        offs_qk = offs_k
        mask_qk = mask_k

    start = tl.load(starts_ptr + n).to(tl.int64)
    length = (tl.load(ends_ptr + n).to(tl.int64) - start).to(tl.int32)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    has_init = tl.load(init_ptr + n) != 0
    s_ptrs = (
        state_ptr + slot * stride_sn + h * stride_sh + offs_v[:, None] * stride_sv + offs_k[None, :]
    )  # [BV, BK]
    # NOTE: a masked load, not a multiply: a fresh slot's garbage (even NaN) is never read
    S = tl.load(s_ptrs, mask=mask_s & has_init, other=0.0).to(tl.float32)  # [BV, BK]
    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    o_base = out_ptr + h * stride_oh + offs_v

    q, k, v, a, b = _load_token(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, start, length > 0, hk, h, offs_qk, offs_v,
        mask_qk, mask_v, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
        stride_an, stride_ah, stride_bn, stride_bh,
    )  # fmt: skip
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a loaded bound
        t = 0
        while t < length:
            row = start + t
            nq, nk, nv, na, nb = _load_token(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, row + 1, t + 1 < length, hk, h, offs_qk,
                offs_v, mask_qk, mask_v, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn,
                stride_vh, stride_an, stride_ah, stride_bn, stride_bh,
            )  # fmt: skip
            o, S = _delta_step(S, q, k, v, a, b, neg_A, dt_bias, scale, ROW_QK)
            tl.store(o_base + row * stride_on, o.to(out_ptr.dtype.element_ty), mask=mask_v)
            q, k, v, a, b = nq, nk, nv, na, nb
            t += 1
    else:
        for t in tl.range(0, length):
            row = start + t
            # the next token's loads go out before this token's math (software pipelining)
            nq, nk, nv, na, nb = _load_token(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, row + 1, t + 1 < length, hk, h, offs_qk,
                offs_v, mask_qk, mask_v, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn,
                stride_vh, stride_an, stride_ah, stride_bn, stride_bh,
            )  # fmt: skip
            o, S = _delta_step(S, q, k, v, a, b, neg_A, dt_bias, scale, ROW_QK)
            tl.store(o_base + row * stride_on, o.to(out_ptr.dtype.element_ty), mask=mask_v)
            q, k, v, a, b = nq, nk, nv, na, nb
    # NOTE: an empty sequence leaves its slot untouched (as the reference does)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_s & (length > 0))


def prefill_tiling(head_v_dim: int, head_k_dim: int) -> tuple[int, int]:
    """(BV, num_warps) by shape, fixed (no autotuning: one plain launch is the point).

    One warp per program: its reductions over K and its q / k rows need no barrier nor layout
    conversion in the token loop (see the kernel's NOTE). BV=8 at K=128 (32 state values per
    lane, 80 registers on sm_90) gives HV * V / 8 = 512 one-warp programs per sequence at 9B
    shapes: about one per warp scheduler of an H100 / H200 for a single sequence.
    NOTE: read from the compiled code, not yet timed: `deltaserve bench kernels --only
    gdn_prefill` times this against wider tiles and more warps (its `triton-bv*-w*` rows).
    """
    block_k = triton.next_power_of_2(head_k_dim)
    if interpreting():  # CPU interpreter: fewest programs is fastest
        return triton.next_power_of_2(head_v_dim), 4
    block_v = 4 if block_k > 128 else 8 if block_k == 128 else 16
    return min(block_v, triton.next_power_of_2(head_v_dim)), 1


def check_prefill_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ssm_state: torch.Tensor
) -> None:
    """Raise ValueError naming what the kernel cannot take (shapes, dtypes, head dims)."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want q, k [T, HK, K] "
            "and v [T, HV, V]"
        )
    num_k_heads, head_k = q.shape[1:]
    num_v_heads, head_v = v.shape[1:]
    if num_k_heads == 0 or num_v_heads % num_k_heads:
        raise ValueError(f"HV={num_v_heads} is not a multiple of HK={num_k_heads}")
    if head_k > MAX_HEAD_DIM or head_v > MAX_HEAD_DIM:
        raise ValueError(
            f"head dims K={head_k}, V={head_v} unsupported by the Triton GDN prefill "
            f"(at most {MAX_HEAD_DIM})"
        )
    if ssm_state.dim() != 4 or ssm_state.shape[1:] != (num_v_heads, head_v, head_k):
        raise ValueError(
            f"ssm_state {tuple(ssm_state.shape)} is not [num_slots, HV={num_v_heads}, "
            f"V={head_v}, K={head_k}]"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in ACT_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} unsupported (bfloat16, float16, float32)")
    if ssm_state.dtype not in STATE_DTYPES:
        raise ValueError(f"ssm_state dtype {ssm_state.dtype} unsupported (float32, bfloat16)")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is unit-stride (what the kernel's pointers assume)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def gdn_prefill_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> None:
    """The gated delta rule over the token rows `starts[n] .. ends[n] - 1` of each sequence n,
    in one launch, in place on `ssm_state` and `out` (rows of no sequence are not written).

    Args:
        q, k: [T, HK, K] raw (un-normalised) queries and keys; v: [T, HV, V]; any row strides.
        a, b: [T, HV] raw gate inputs. A_log, dt_bias: [HV].
        ssm_state: [num_slots, HV, V, K] float32 or bfloat16 pool; the slots of the sequences
            (distinct) are read (where `has_initial_state`) and written.
        starts, ends: [N] integer token rows of each sequence (device).
        state_slots: [N] int64 pool slot per sequence. has_initial_state: [N] bool.
        out: [T, HV, V] output rows, written for the sequences' tokens in out's dtype.
        block_v, num_warps: override the tiling (benchmarks).
    """
    check_prefill_args(q, k, v, ssm_state)
    num_seqs = state_slots.shape[0]
    if not (starts.shape == ends.shape == has_initial_state.shape == (num_seqs,)):
        raise ValueError(
            f"starts {tuple(starts.shape)}, ends {tuple(ends.shape)}, has_initial_state "
            f"{tuple(has_initial_state.shape)}: want [N={num_seqs}] each"
        )
    if out.shape != v.shape:
        raise ValueError(f"out {tuple(out.shape)} is not v's shape {tuple(v.shape)}")
    if num_seqs == 0:
        return
    num_v_heads, head_v = v.shape[1:]
    num_k_heads, head_k = q.shape[1:]
    q, k, v, out_k = (_unit_last(t) for t in (q, k, v, out))
    if ssm_state.stride(-1) != 1:
        raise ValueError("ssm_state's last dim must be unit-stride (updated in place)")
    heur_v, heur_warps = prefill_tiling(head_v, head_k)
    block_v = block_v or heur_v
    grid = (num_seqs * num_v_heads * triton.cdiv(head_v, block_v),)
    _gdn_prefill_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, ssm_state,
        starts, ends, state_slots, has_initial_state, out_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        out_k.stride(0), out_k.stride(1),
        head_k**-0.5,
        HV=num_v_heads,
        GROUP=num_v_heads // num_k_heads,
        K=head_k,
        V=head_v,
        BK=triton.next_power_of_2(head_k),
        BV=block_v,
        ROW_QK=(num_warps or heur_warps) == 1,
        INTERPRET=interpreting(),
        num_warps=num_warps or heur_warps,
    )  # fmt: skip
    if out_k is not out:
        out.copy_(out_k)


class TritonGDNPrefill(GDNPrefillBackend):
    """Every prefill sequence through the token-by-token Triton kernel (`gdn_prefill_rows`):
    one launch per layer call, correct for any row length, fast only for short rows."""

    name = "triton"

    def __init__(self, block_v: int | None = None, num_warps: int | None = None) -> None:
        self.block_v = block_v  # None: `prefill_tiling`'s choice (overrides: benchmarks)
        self.num_warps = num_warps

    def forward(
        self,
        q: torch.Tensor,  # [Tp, HK, K]
        k: torch.Tensor,  # [Tp, HK, K]
        v: torch.Tensor,  # [Tp, HV, V]
        a: torch.Tensor,  # [Tp, HV]
        b: torch.Tensor,  # [Tp, HV]
        A_log: torch.Tensor,  # [HV]
        dt_bias: torch.Tensor,  # [HV]
        ssm_state: torch.Tensor,  # [num_slots, HV, V, K]
        meta: PrefillMetadata,
    ) -> torch.Tensor:  # [Tp, HV, V] in v's dtype
        total = meta.query_start_loc_cpu[-1]  # tokens owned by the sequences (<= Tp)
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
        if total < v.shape[0]:  # rows no sequence owns come back zero
            out[total:].zero_()
        qsl = meta.query_start_loc  # [P + 1]
        gdn_prefill_rows(
            q, k, v, a, b, A_log, dt_bias, ssm_state,
            qsl[:-1], qsl[1:], meta.state_slots, meta.has_initial_state, out,
            self.block_v, self.num_warps,
        )  # fmt: skip
        return out
