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
ahead (in registers), so their load latency hides behind the current token's math, and the
tiling (`PrefillTiling`) keeps the sums over K inside a warp with few shuffles. Sequences
are given by (start, end) token rows, so a subset of a batch's sequences runs in place, on the
batch's own q / k / v / out rows, without gathers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaserve.forward_context import PrefillMetadata
from deltaserve.ops.gdn import GDNPrefillBackend
from deltaserve.ops.specialize import INDEX_ARGS

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
    QK_SHAPE: tl.constexpr,
):
    """q, k [QK_SHAPE] (offs_k [1, NC, CK] broadcast: a copy per state row or one), v [BV] and
    the raw gate inputs a, b of one token, in their dtypes."""
    q_ptrs = q_ptr + row * stride_qn + hk * stride_qh + offs_k
    k_ptrs = k_ptr + row * stride_kn + hk * stride_kh + offs_k
    q = tl.load(tl.broadcast_to(q_ptrs, QK_SHAPE), mask=mask_k & valid, other=0.0)
    k = tl.load(tl.broadcast_to(k_ptrs, QK_SHAPE), mask=mask_k & valid, other=0.0)
    v = tl.load(v_ptr + row * stride_vn + h * stride_vh + offs_v, mask=mask_v & valid, other=0.0)
    a = tl.load(a_ptr + row * stride_an + h * stride_ah, mask=valid, other=0.0)
    b = tl.load(b_ptr + row * stride_bn + h * stride_bh, mask=valid, other=0.0)
    # NOTE: returned as loaded (converted where used, a token later): a conversion here would
    # make the warp wait for the prefetch it has just issued
    return q, k, v, a, b


@triton.jit
def _delta_step(S, q, k, v, a, b, neg_A, dt_bias, scale):
    """One token of the gated delta rule on a [BV, NC, CK] float32 state tile (K split in NC
    chunks of CK), raw q and k [BV or 1, NC, CK] (rows all the same), v [BV] (any float
    dtypes: the math is float32): (o [BV], new S).

    q and k are normalised through scalars, not vectors: with rq = scale / |q|, rk = 1 / |k|
    (eps inside the rsqrt, as the reference), S k = rk (S k_raw), S += (beta (v - S k) rk) k_raw
    and o = rq (S q_raw): the same math with two passes over the tile fewer.
    """
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    a = a.to(tl.float32)
    b = b.to(tl.float32)
    rq = tl.rsqrt(tl.sum(tl.sum(q * q, axis=1), axis=1) + 1e-6) * scale  # [BV] or [1]
    rk = tl.rsqrt(tl.sum(tl.sum(k * k, axis=1), axis=1) + 1e-6)
    # g = -exp(A_log) * softplus(a + dt_bias) (softplus linear past 20, as torch's), beta
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = neg_A * softplus
    beta = 1.0 / (1.0 + tl.exp(-b))
    # S = exp(g) S;  S += beta (v - S k) k^T;  o = S q  (sums over K: in-lane, then the lanes)
    S = S * tl.exp(g)
    predicted = tl.sum(tl.sum(S * k, axis=1), axis=1) * rk  # [BV]
    S = S + (beta * (v - predicted) * rk)[:, None, None] * k
    o = tl.sum(tl.sum(S * q, axis=1), axis=1) * rq  # [BV]
    return o, S


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
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
    ckpt_ptr,  # [N] int64: tokens after which to snapshot the state (0: none; CKPT only)
    ckpt_rows_ptr,  # [N] int64: the state row the snapshot goes to (CKPT only)
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
    CK: tl.constexpr,  # K is handled as BK // CK chunks of CK (a power of two)
    QK_B: tl.constexpr,  # rows of q and k loaded: BV (a copy per state row) or 1
    CKPT: tl.constexpr,  # the step takes in-step snapshots (ckpt_ptr / ckpt_rows_ptr are read)
    INTERPRET: tl.constexpr,
):
    """Grid (N * HV * cdiv(V, BV),): one sequence's tokens through a [BV, K] state tile, held
    as [BV, BK // CK, CK] (K in chunks of CK).

    NOTE on layouts (read from the compiled TTGIR for sm_90; `PrefillTiling` says why): the
    loop's layout is the one of the q / k loads, and the state tile is converted to it once
    before the loop and back once after. q and k loaded as [BV, NC, CK] copies (QK_B = BV) take
    lanes over rows and over at most CK / 8 of K, so the sums over K cross few lanes; loaded
    once ([1, NC, CK]) they spread all lanes over K.

    With CKPT, a sequence whose checkpoint h is > 0 also stores its state after token h - 1
    (the state at the boundary h of a prefix-cache snapshot) to row `ckpt_rows[n]` of the pool,
    from inside the token loop: no second launch, no gathers.
    """
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    pid_v = pid % NV
    pid_nh = pid // NV
    n = pid_nh // HV
    h = pid_nh % HV
    hk = h // GROUP

    NC: tl.constexpr = BK // CK
    offs_k = tl.arange(0, NC)[None, :, None] * CK + tl.arange(0, CK)[None, None, :]  # [1, NC, CK]
    offs_v = pid_v * BV + tl.arange(0, BV)  # [BV]
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_s = (offs_v < V)[:, None, None] & mask_k  # [BV, NC, CK]

    start = tl.load(starts_ptr + n).to(tl.int64)
    length = (tl.load(ends_ptr + n).to(tl.int64) - start).to(tl.int32)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    has_init = tl.load(init_ptr + n) != 0
    s_ptrs = (
        state_ptr + slot * stride_sn + h * stride_sh + offs_v[:, None, None] * stride_sv + offs_k
    )  # [BV, NC, CK]
    # NOTE: a masked load, not a multiply: a fresh slot's garbage (even NaN) is never read
    S = tl.load(s_ptrs, mask=mask_s & has_init, other=0.0).to(tl.float32)  # [BV, NC, CK]
    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    o_base = out_ptr + h * stride_oh + offs_v
    ckpt = 0  # tokens after which the snapshot is stored (0: none)
    c_ptrs = s_ptrs
    if CKPT:
        ckpt = tl.load(ckpt_ptr + n).to(tl.int32)
        c_row = tl.load(ckpt_rows_ptr + n).to(tl.int64)
        c_ptrs = s_ptrs + (c_row - slot) * stride_sn  # the same tile of the snapshot row

    q, k, v, a, b = _load_token(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, start, length > 0, hk, h, offs_k, offs_v,
        mask_k, mask_v, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
        stride_an, stride_ah, stride_bn, stride_bh, (QK_B, NC, CK),
    )  # fmt: skip
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a loaded bound
        t = 0
        while t < length:
            row = start + t
            nq, nk, nv, na, nb = _load_token(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, row + 1, t + 1 < length, hk, h, offs_k,
                offs_v, mask_k, mask_v, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn,
                stride_vh, stride_an, stride_ah, stride_bn, stride_bh, (QK_B, NC, CK),
            )  # fmt: skip
            o, S = _delta_step(S, q, k, v, a, b, neg_A, dt_bias, scale)
            tl.store(o_base + row * stride_on, o.to(out_ptr.dtype.element_ty), mask=mask_v)
            if CKPT:
                if t + 1 == ckpt:
                    tl.store(c_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_s)
            q, k, v, a, b = nq, nk, nv, na, nb
            t += 1
    else:
        for t in tl.range(0, length):
            row = start + t
            # the next token's loads go out before this token's math (software pipelining)
            nq, nk, nv, na, nb = _load_token(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, row + 1, t + 1 < length, hk, h, offs_k,
                offs_v, mask_k, mask_v, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn,
                stride_vh, stride_an, stride_ah, stride_bn, stride_bh, (QK_B, NC, CK),
            )  # fmt: skip
            o, S = _delta_step(S, q, k, v, a, b, neg_A, dt_bias, scale)
            tl.store(o_base + row * stride_on, o.to(out_ptr.dtype.element_ty), mask=mask_v)
            if CKPT:
                if t + 1 == ckpt:
                    tl.store(c_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_s)
            q, k, v, a, b = nq, nk, nv, na, nb
    # NOTE: an empty sequence leaves its slot untouched (as the reference does)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_s & (length > 0))


@dataclass(frozen=True)
class PrefillTiling:
    """How the kernel cuts its work (all compile-time constants).

    block_v: state rows (BV) per program. num_warps: warps per program. chunk_k: the K axis is
    held as K / chunk_k chunks of chunk_k: lanes then spread over chunk_k / (16 bytes of q) of K
    and the rest over rows, so the sums over K cross fewer lanes. qk_rows: q and k loaded as a
    copy per state row (their layout then equals the tile's: no conversion in the loop, more
    registers) or once per program.
    """

    block_v: int
    num_warps: int
    chunk_k: int
    qk_rows: bool

    @property
    def name(self) -> str:
        rows = "-rows" if self.qk_rows else ""
        return f"bv{self.block_v}-w{self.num_warps}-ck{self.chunk_k}{rows}"


def prefill_tiling(head_v_dim: int, head_k_dim: int) -> PrefillTiling:
    """The tiling by shape, fixed (no autotuning: one plain launch is the point).

    At K = V = 128 (read from the compiled code for sm_90, not yet timed): one warp of 8 state
    rows with q and k copied per row and K in chunks of 32. Each lane holds one row's 32 state
    values (8 lanes of rows x 4 lanes of K, 8 contiguous values per lane and chunk), so a sum
    over K is 32 in-lane adds and 2 shuffle steps, with no barrier and no shared memory in the
    token loop; 156 registers, no spills. The alternative of all 32 lanes along K (chunk_k =
    K, one q / k copy: 80 registers) needs ~90 shuffles per token against ~40.
    `deltaserve bench kernels --only gdn_prefill` times the variants (its `triton-*` rows).
    """
    block_k = triton.next_power_of_2(head_k_dim)
    if interpreting():  # CPU interpreter: fewest programs and ops are fastest
        return PrefillTiling(triton.next_power_of_2(head_v_dim), 4, block_k, False)
    # NOTE: a lane holds its row's state and q / k copies, 3 * BV * BK / 32 values: BV=4 at
    # K=256 (BV=8 spills there)
    block_v = min(8 if block_k <= 128 else 4, triton.next_power_of_2(head_v_dim))
    return PrefillTiling(block_v, 1, min(32, block_k), True)


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


def check_rows_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ssm_state: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor,
    checkpoints: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """`check_prefill_args` plus the per-sequence and output arguments of the one-launch row
    kernels (`gdn_prefill_rows` here, `triton_chunked.gdn_chunked_rows`): ValueError naming
    what is wrong."""
    check_prefill_args(q, k, v, ssm_state)
    num_seqs = state_slots.shape[0]
    if not (starts.shape == ends.shape == has_initial_state.shape == (num_seqs,)):
        raise ValueError(
            f"starts {tuple(starts.shape)}, ends {tuple(ends.shape)}, has_initial_state "
            f"{tuple(has_initial_state.shape)}: want [N={num_seqs}] each"
        )
    if out.shape != v.shape:
        raise ValueError(f"out {tuple(out.shape)} is not v's shape {tuple(v.shape)}")
    if a.shape != v.shape[:2] or b.shape != v.shape[:2]:
        raise ValueError(
            f"a {tuple(a.shape)}, b {tuple(b.shape)}: want [T, HV] = {tuple(v.shape[:2])}"
        )
    if checkpoints is not None and not (
        checkpoints[0].shape == checkpoints[1].shape == (num_seqs,)
    ):
        shapes = [tuple(t.shape) for t in checkpoints]
        raise ValueError(f"checkpoints {shapes}: want heads and rows [N={num_seqs}] each")
    if ssm_state.stride(-1) != 1:
        raise ValueError("ssm_state's last dim must be unit-stride (updated in place)")


def prefill_out(v: torch.Tensor, meta: PrefillMetadata) -> torch.Tensor:
    """The output rows [Tp, HV, V] of a prefill backend's call, contiguous in v's dtype: rows
    no sequence owns (past `meta`'s tokens) zero, the rest left for the kernel to write."""
    total = meta.query_start_loc_cpu[-1]  # tokens owned by the sequences (<= Tp)
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    if total < v.shape[0]:
        out[total:].zero_()
    return out


def unit_last(t: torch.Tensor) -> torch.Tensor:
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
    tiling: PrefillTiling | None = None,
    *,
    checkpoints: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        tiling: overrides `prefill_tiling`'s choice (tests, benchmarks).
        checkpoints: (heads [N], rows [N]) integer tensors: sequence n with heads[n] = h > 0
            (0 < h < its length) also stores its state after its first h tokens to
            `ssm_state[rows[n]]` (a row no sequence of the call uses), in the pool's dtype.
    """
    check_rows_args(
        q, k, v, a, b, ssm_state, starts, ends, state_slots, has_initial_state, out, checkpoints
    )
    num_seqs = state_slots.shape[0]
    if num_seqs == 0:
        return
    num_v_heads, head_v = v.shape[1:]
    num_k_heads, head_k = q.shape[1:]
    q, k, v, out_k = (unit_last(t) for t in (q, k, v, out))
    tiling = tiling or prefill_tiling(head_v, head_k)
    block_k = triton.next_power_of_2(head_k)
    if block_k % tiling.chunk_k:
        raise ValueError(f"chunk_k={tiling.chunk_k} does not divide {block_k}")
    grid = (num_seqs * num_v_heads * triton.cdiv(head_v, tiling.block_v),)
    _gdn_prefill_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, ssm_state,
        starts, ends, state_slots, has_initial_state, out_k,
        *(checkpoints if checkpoints is not None else (starts, starts)),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        out_k.stride(0), out_k.stride(1),
        head_k**-0.5,
        HV=num_v_heads,
        GROUP=num_v_heads // num_k_heads,
        K=head_k,
        V=head_v,
        BK=block_k,
        BV=tiling.block_v,
        CK=tiling.chunk_k,
        QK_B=tiling.block_v if tiling.qk_rows else 1,
        CKPT=checkpoints is not None,
        INTERPRET=interpreting(),
        num_warps=tiling.num_warps,
    )  # fmt: skip
    if out_k is not out:
        out.copy_(out_k)


class TritonGDNPrefill(GDNPrefillBackend):
    """Every prefill sequence through the token-by-token Triton kernel (`gdn_prefill_rows`):
    one launch per layer call, correct for any row length, fast only for short rows. It takes
    a step's in-step snapshots inside the kernel."""

    name = "triton"

    def takes_checkpoints(self, meta: PrefillMetadata) -> bool:
        return True

    def __init__(self, tiling: PrefillTiling | None = None) -> None:
        self.tiling = tiling  # None: `prefill_tiling`'s choice (overrides: benchmarks)

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
        out = prefill_out(v, meta)
        qsl = meta.query_start_loc  # [P + 1]
        gdn_prefill_rows(
            q, k, v, a, b, A_log, dt_bias, ssm_state,
            qsl[:-1], qsl[1:], meta.state_slots, meta.has_initial_state, out,
            self.tiling, checkpoints=meta.checkpoint_tensors(),
        )  # fmt: skip
        return out
