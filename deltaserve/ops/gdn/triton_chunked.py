"""Triton GDN prefill in chunks (tensor cores), ONE plain launch per call.

The contract of `triton_prefill.gdn_prefill_rows` (the token-by-token kernel), plus in-kernel
checkpoints, with the chunked WY / UT-transform form of the gated delta rule (the math of
`deltaserve.ops.gdn`; its torch reference, step by step, is `reference.chunk_gated_delta_rule`).
Within a chunk of C tokens from state S0 ([V, K], "K-last"), with gamma_i the cumulative log
decay from the chunk start and D_ij = exp(gamma_i - gamma_j) (j <= i):

    A   = strictly_lower(beta_i D_ij k_i . k_j)                      [C, C]
    U   = (I + A)^-1 (beta V - (beta exp(gamma) K) S0^T)             [C, V]
    O   = (exp(gamma) Q) S0^T + ((Q K^T) * D) U                      [C, V]
    S_C = exp(gamma_C) S0 + U^T (exp(gamma_C - gamma) K)            [V, K]

Grid (N * HV * cdiv(V, BV),): one program per (sequence n, value head h, tile of BV value
rows) walks the sequence's chunks of up to BT tokens in order, so the launch needs no host
knowledge of the row lengths (no host sync, no autotuner; the grid depends on N and the head
counts only). Per chunk every product is a `tl.dot` on tensor cores (q, k, v and the gates
loaded once per chunk; l2norm of q and k with eps 1e-6 inside the rsqrt, q scaled by
K ** -0.5, g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), all float32 math).
What does not depend on V (k k^T, q k^T, the triangular solve's matrix) is repeated per V
tile: BV = 64 (two programs per head at V = 128) measured faster than 128 or 32.

Between chunks the state tile lives in the sequence's own pool row (an L2 round trip per
chunk), not in registers: the chunk step is a `noinline` function (`_chunk_step`, scalar
arguments only). Inlined into the chunk loop, the compiler hoisted the ~60 wgmma
shared-memory descriptors of its ~14 dots out of the loop and spilled them (255 registers
and ~600 bytes of spills at every tiling tried); carrying the state in registers also hit
a Triton sm_90 code-generation fault (an out-of-range shared-memory access, from the bf16
copy of the loop-carried accumulator). The price: a bfloat16 pool's state is rounded to
bfloat16 at each chunk boundary (a float32 pool: exact), and ptxas serialises the wgmma
pipeline at the call.

The unit lower-triangular solve U = (I + A)^-1 R, A strictly lower (C = NB blocks of 16):
  1. the NB diagonal 16 x 16 blocks are inverted by forward substitution, all NB at once
     ([NB, 16, 16] tiles, 15 row steps of elementwise float32 math);
  2. with Dg^-1 that block-diagonal inverse and E = A's strictly-block-lower part,
     I + A = (I + M) Dg with M = E Dg^-1, and M^NB = 0 (strictly block lower), so
     (I + A)^-1 = Dg^-1 sum_{p < NB} (-M)^p, summed by Horner's rule X <- Dg^-1 - X M
     (NB - 1 dots), then U = X R. Its terms are those of block forward substitution
     (fla-core's 16 -> 64 merge): as sound, with no power of A alone (those grow).

Precision: the products of q and k (bf16 on the GPU) with each other are exact (16-bit
operands, float32 accumulation); the other operands are float32, multiplied as "bf16x3"
(`_dot_f32`: each split as bf16 hi + lo, three bf16 dots: ~16 mantissa bits) by default.
Measured at 9B shapes on an H200 (16 x 136 tokens, bf16 in, float32 pool), against the
float32 reference: final state rel. err 3.7e-6 (tf32: 4.3e-4; "ieee", CUDA cores: 2.6e-6 but
several times slower), output rel. err 1.7e-3, the token-by-token kernel's (bf16 rounding).

Checkpoints (prefix-cache snapshots inside a row): a sequence with ckpt_lens[n] = h > 0 ends a
chunk at h (chunks of its first h tokens, then of the rest), so the state after h tokens is a
chunk boundary's, exact, and is stored to `ssm_state[ckpt_rows[n]]` by the chunk that ends
there.

Sequences are given by (start, end) token rows, so a subset of a batch's sequences runs in
place on the batch's own q / k / v / out rows, without gathers; rows of no sequence are not
written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaserve.forward_context import PrefillMetadata
from deltaserve.ops.gdn import GDNPrefillBackend
from deltaserve.ops.gdn.triton_prefill import (
    check_rows_args,
    interpreting,
    prefill_out,
    unit_last,
)
from deltaserve.ops.specialize import INDEX_ARGS

PRECISIONS = ("bf16x3", "tf32", "tf32x3", "ieee")


@triton.jit
def _dot_f32(x, y, acc, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + x [M, R] @ y [R, N], both float32 (acc None: zeros).

    PRECISION "bf16x3": each operand split as hi + lo in bfloat16 (16 mantissa bits of 24)
    and hi.hi + hi.lo + lo.hi summed on 16-bit tensor cores (the lo.lo term, ~2^-16 of the
    product, dropped); else tl.dot's input_precision ("tf32": one tf32 pass, 10 bits;
    "tf32x3"; "ieee": no tensor cores).
    """
    if acc is None:
        acc = tl.zeros((x.shape[0], y.shape[1]), dtype=tl.float32)
    if PRECISION == "bf16x3":
        x_hi = x.to(tl.bfloat16)
        x_lo = (x - x_hi.to(tl.float32)).to(tl.bfloat16)
        y_hi = y.to(tl.bfloat16)
        y_lo = (y - y_hi.to(tl.float32)).to(tl.bfloat16)
        if INTERPRET:  # NOTE: the interpreter's tl.dot multiplies bf16 bit patterns
            x_hi, x_lo = x_hi.to(tl.float32), x_lo.to(tl.float32)
            y_hi, y_lo = y_hi.to(tl.float32), y_lo.to(tl.float32)
        acc = tl.dot(x_lo, y_hi, acc)
        acc = tl.dot(x_hi, y_lo, acc)
        return tl.dot(x_hi, y_hi, acc)
    else:
        return tl.dot(x, y, acc, input_precision=PRECISION)


@triton.jit
def _unit_lower_solve(A, R, lz, BT: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """(I + A)^-1 R for A [BT, BT] float32 strictly lower triangular (BT = 16 * a power of 2) and
    R [BT, BV] float32.

    Forward substitution on the NB = BT / 16 diagonal 16 x 16 blocks at once gives their
    block-diagonal inverse Dg^-1; with E the strictly-block-lower rest of A, I + A =
    (I + M) Dg with M = E Dg^-1 strictly block lower (nilpotent: M^NB = 0), so
    (I + A)^-1 = Dg^-1 sum_{p < NB} (-M)^p, summed by Horner's rule X <- Dg^-1 - X M from
    the right (NB - 1 dots whose shared-memory operand is always M), then U = X R.

    `lz` is an int32 zero the compiler cannot see through (see `_chunk_step`): the masks built
    from it stay inside the chunk loop instead of living in registers across it.
    """
    NB: tl.constexpr = BT // 16
    blk_r = (tl.arange(0, NB) + lz)[:, None, None, None]
    blk_c = (tl.arange(0, NB) + lz)[None, None, :, None]
    A4 = tl.reshape(A, (NB, 16, NB, 16))  # [row block, row, col block, col]
    A3 = tl.sum(tl.where(blk_r == blk_c, A4, 0.0), axis=2)  # [NB, 16, 16] diagonal blocks
    # XT[b, c, j] = X[b, j, c]: block b's inverse X, transposed, rows j < i final at step i
    # (rows j >= i still the identity's, and A[i, j] = 0 there). NOTE: transposed, so A3, XT
    # and both sums share one layout: no layout conversion (a round trip through shared
    # memory) in the loop
    row = (tl.arange(0, 16) + lz)[None, :, None]  # axis 1 (of A3: its row i)
    col = (tl.arange(0, 16) + lz)[None, None, :]  # axis 2 (of XT: X's row j)
    XT = tl.where(row == col, 1.0, 0.0) + tl.zeros_like(A3)  # [NB, 16, 16]: I
    for i in range(1, 16):
        # X[i, :] = e_i - sum_{j < i} A[i, j] X[j, :]
        a = -tl.sum(tl.where(row == i, A3, 0.0), axis=1)  # [NB, 16]: -A[i, j] (b, j)
        x = tl.sum(a[:, None, :] * XT, axis=2)  # [NB, 16]: X[i, c] - [c == i] (b, c)
        XT = tl.where(col == i, x[:, :, None] + tl.where(row == i, 1.0, 0.0), XT)
    X3 = tl.permute(XT, (0, 2, 1))  # [NB, 16, 16]: the diagonal blocks' inverses
    Xd = tl.reshape(tl.where(blk_r == blk_c, X3[:, :, None, :], 0.0), (BT, BT))  # Dg^-1
    X = Xd
    if NB > 1:
        offs = tl.arange(0, BT) + lz
        E = tl.where((offs[:, None] // 16) != (offs[None, :] // 16), A, 0.0)
        M = _dot_f32(E, Xd, None, PRECISION, INTERPRET)  # [BT, BT]: E Dg^-1
        for _ in tl.static_range(NB - 1):
            X = Xd - _dot_f32(X, M, None, PRECISION, INTERPRET)
    U = _dot_f32(X, R, None, PRECISION, INTERPRET)  # [BT, BV]
    return U


@triton.jit
def _dot_act(x, y, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """x [M, R] @ y [R, N] -> float32, both in the activations' dtype: 16-bit operands multiply
    exactly (float32 accumulation); float32 ones at PRECISION."""
    if x.dtype == tl.float32:
        return _dot_f32(x, y, None, PRECISION, INTERPRET)
    else:
        if INTERPRET:  # NOTE: the interpreter's tl.dot multiplies bf16 bit patterns
            return tl.dot(x.to(tl.float32), y.to(tl.float32))
        return tl.dot(x, y)


@triton.jit
def _dot_mixed(x, y, acc, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + x [M, R] @ y [R, N]: x in the activations' dtype, y float32.

    bfloat16 x: y is split as y_hi + y_lo, both bfloat16 (about 16 mantissa bits of y: a
    relative error <= 2^-17), and x multiplies each exactly on 16-bit tensor cores (two dots,
    cheaper and closer than one tf32 dot). float16 or float32 x: float32 at PRECISION.
    """
    if x.dtype == tl.bfloat16:
        y_hi = y.to(tl.bfloat16)
        y_lo = (y - y_hi.to(tl.float32)).to(tl.bfloat16)
        if INTERPRET:  # NOTE: the interpreter's tl.dot multiplies bf16 bit patterns
            x32 = x.to(tl.float32)
            acc = tl.dot(x32, y_hi.to(tl.float32), acc)
            return tl.dot(x32, y_lo.to(tl.float32), acc)
        acc = tl.dot(x, y_hi, acc)
        return tl.dot(x, y_lo, acc)
    else:
        return _dot_f32(x.to(tl.float32), y, acc, PRECISION, INTERPRET)


@triton.jit(noinline=True)
def _chunk_step(
    q_ptr,  # the kernel's arguments, as they are (see _gdn_chunked_kernel)
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    A_log_ptr,
    dt_bias_ptr,
    state_ptr,
    starts_ptr,
    slots_ptr,
    init_ptr,
    ckpt_rows_ptr,
    out_ptr,
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
    scale,
    done,  # int32: the sequence's tokens behind this chunk
    count,  # int32: the chunk's tokens (1 .. BT)
    store_ckpt,  # int1: the state after this chunk is also the snapshot (CKPT only)
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    PRECISION: tl.constexpr,
    INV_PRECISION: tl.constexpr,
    CKPT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One chunk of `count` tokens: writes its outputs [count, BV] and the state tile after it
    (the math of `reference.chunk_gated_delta_rule`), in place.

    q and k enter every product raw, in their dtype (bf16 on the GPU: exact products, and
    operands that stay in shared memory); their l2 norms and the scale are applied as row /
    column factors of the products' results (rq, rk): the same math.

    NOTE on registers (read from the compiled code for sm_90; `ChunkedTiling` says more): this
    function is not inlined (`noinline`: its arguments are scalars, so the state travels
    through its pool row, in L2, between chunks). Inlined into the chunk loop, the ~60 wgmma
    shared-memory descriptors of its ~14 dots were hoisted out of the loop by the compiler
    and held (spilled) in registers throughout. In here the state is read twice (as a
    product operand, then as the update's accumulator) rather than held across the chunk.
    Every [BT, BT] mask is built from `lz`, a zero the compiler cannot prove (count <= BT),
    and the decay matrix twice (for A, then for Q K^T), so neither is computed early and
    held; the work is ordered so few [BT, BT] tiles live at once.
    """
    # NOTE: what the program is, read again here rather than passed in: every value the
    # chunk loop holds across this call is saved to and restored from local memory around it
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    pid_nh = pid // NV
    n = pid_nh // HV
    h = pid_nh % HV
    hk = h // GROUP
    v0 = (pid % NV) * BV
    rem_v = V - v0  # the tile's value rows in range
    row0 = tl.load(starts_ptr + n).to(tl.int64) + done  # the chunk's first token row
    read_state = (done > 0) | (tl.load(init_ptr + n) != 0)  # else: zeros (never read)
    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    q_base = q_ptr + row0 * stride_qn + hk * stride_qh
    k_base = k_ptr + row0 * stride_kn + hk * stride_kh
    a_base = a_ptr + row0 * stride_an + h * stride_ah
    b_base = b_ptr + row0 * stride_bn + h * stride_bh

    lz = (count - 1) // BT  # 0: see the NOTE
    offs_t = tl.arange(0, BT) + lz  # [BT]: the token index within the chunk
    ti = offs_t
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    valid = offs_t < count  # [BT]
    if K < BK:
        m_qk = valid[:, None] & (offs_k < K)[None, :]
    else:
        m_qk = valid[:, None]
    if V % BV:
        m_v = valid[:, None] & (offs_v < rem_v)[None, :]
    else:
        m_v = valid[:, None]
    q = tl.load(
        q_base + offs_t[:, None] * stride_qn + offs_k[None, :], mask=m_qk, other=0.0
    )  # [BT, BK]
    k = tl.load(
        k_base + offs_t[:, None] * stride_kn + offs_k[None, :], mask=m_qk, other=0.0
    )  # [BT, BK]
    a = tl.load(a_base + offs_t * stride_an, mask=valid, other=0.0).to(tl.float32)  # [BT]
    b = tl.load(b_base + offs_t * stride_bn, mask=valid, other=0.0).to(tl.float32)

    # gates (softplus linear past 20, as torch's); rows past the chunk: g = 0, beta = 0, k = 0
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = tl.where(valid, neg_A * softplus, 0.0)  # [BT] log decay, <= 0
    beta = tl.where(valid, 1.0 / (1.0 + tl.exp(-b)), 0.0)  # [BT]
    gamma = tl.cumsum(g, axis=0)  # [BT] log decay from the chunk start
    gamma_end = tl.sum(tl.where(ti == BT - 1, gamma, 0.0), axis=0)  # = the last token's
    q32 = q.to(tl.float32)
    k32 = k.to(tl.float32)
    rq = tl.rsqrt(tl.sum(q32 * q32, axis=1) + 1e-6) * scale  # [BT]: q_i = rq_i q_raw_i
    rk = tl.rsqrt(tl.sum(k32 * k32, axis=1) + 1e-6)  # [BT]

    # K S0^T
    eg = tl.exp(gamma)  # [BT]
    zero = tl.zeros((BT, BV), dtype=tl.float32)
    s_tile = state_ptr + _state_row(slots_ptr, n, 0, h, v0, stride_sn, stride_sh, stride_sv)
    s_ptrs, mask_s = _state_tile(s_tile, 0, stride_sv, rem_v, K, V, BK, BV)
    # NOTE: the barrier orders the previous chunk's state stores (other threads') first
    tl.debug_barrier()
    St = tl.load(s_ptrs, mask=mask_s & read_state, other=0.0).to(tl.float32)  # [BK, BV]: S0^T
    ks = _dot_mixed(k, St, zero, PRECISION, INTERPRET)  # [BT, BV]: S0 k_raw_i

    # R = beta V - (beta exp(gamma) K) S0^T
    v_base = v_ptr + row0 * stride_vn + (h * stride_vh + v0)
    v_ptrs = v_base + offs_t[:, None] * stride_vn + offs_v[None, :]
    v = tl.load(v_ptrs, mask=m_v, other=0.0).to(tl.float32)  # [BT, BV]
    rhs = beta[:, None] * (v - (eg * rk)[:, None] * ks)  # [BT, BV]

    # A = strictly_lower(beta_i D_ij k_i . k_j); U = (I + A)^-1 R: what each token writes
    kT = tl.trans(k)  # [BK, BT]
    strict = ti[:, None] > ti[None, :]  # [BT, BT]: j < i
    decay_a = tl.exp(tl.where(strict, gamma[:, None] - gamma[None, :], 0.0))
    kk = _dot_act(k, kT, PRECISION, INTERPRET)  # [BT, BT]: raw k_i . k_j
    A = tl.where(strict, kk * decay_a * ((beta * rk)[:, None] * rk[None, :]), 0.0)
    u = _unit_lower_solve(A, rhs, lz, BT, INV_PRECISION, INTERPRET)  # [BT, BV]

    # O = (exp(gamma) Q) S0^T + ((Q K^T) * D) U
    LOG2E: tl.constexpr = 1.4426950408889634
    g2 = gamma * LOG2E  # NOTE: exp2 here, so this D is not merged with decay_a and kept alive
    # NOTE: token indices built again (another zero, so not merged with `ti`: held across
    # the solve, such index vectors were what spilled)
    tj = tl.arange(0, BT) + (count - 1) // (2 * BT)
    lower = tj[:, None] >= tj[None, :]  # [BT, BT]: j <= i
    decay_o = tl.where(lower, tl.exp2(tl.where(lower, g2[:, None] - g2[None, :], 0.0)), 0.0)
    qk = _dot_act(q, kT, PRECISION, INTERPRET) * decay_o * (rq[:, None] * rk[None, :])
    # NOTE: S0's operand copies wait in shared memory for this (in registers: o held instead)
    o = _dot_mixed(q, St, zero, PRECISION, INTERPRET) * (eg * rq)[:, None]  # [BT, BV]
    o = _dot_f32(qk, u, o, PRECISION, INTERPRET)
    # NOTE: every 64-bit offset is read or built again at its use, with lz in it (not merged
    # with the first): held across the chunk, they were what spilled
    row0 = tl.load(starts_ptr + n + lz).to(tl.int64) + done
    o_base = out_ptr + row0 * stride_on + (h * stride_oh + v0)
    o_ptrs = o_base + offs_t[:, None] * stride_on + offs_v[None, :]
    tl.store(o_ptrs, o.to(o_base.dtype.element_ty), mask=m_v)

    # S^T = exp(gamma_end) S^T + K^T (w U), w_i = rk_i exp(gamma_end - gamma_i)
    wu = u * (rk * tl.exp(gamma_end - gamma))[:, None]  # [BT, BV]
    # NOTE: S0 read again (an L2 hit; pointers from `lz` so not merged with the first read)
    s_tile = state_ptr + _state_row(slots_ptr, n, lz, h, v0, stride_sn, stride_sh, stride_sv)
    s_ptrs, mask_s = _state_tile(s_tile, lz, stride_sv, rem_v, K, V, BK, BV)
    St = tl.load(s_ptrs, mask=mask_s & read_state, other=0.0).to(tl.float32)
    St = _dot_mixed(kT, wu, St * tl.exp(gamma_end), PRECISION, INTERPRET)  # [BK, BV]
    tl.debug_barrier()  # every thread has read S0 before any writes its new value
    tl.store(s_ptrs, St.to(s_tile.dtype.element_ty), mask=mask_s)
    if CKPT:
        if store_ckpt:
            c_row = _state_row(ckpt_rows_ptr, n, lz, h, v0, stride_sn, stride_sh, stride_sv)
            c_tile = state_ptr + c_row
            c_ptrs, mask_c = _state_tile(c_tile, lz, stride_sv, rem_v, K, V, BK, BV)
            tl.store(c_ptrs, St.to(c_tile.dtype.element_ty), mask=mask_c)


@triton.jit
def _state_row(rows_ptr, n, z, h, v0, stride_sn, stride_sh, stride_sv):
    """The offset of S[rows[n], h, v0, 0] in the pool (int64). `z`: an int32 zero (see
    `_state_tile`)."""
    row = tl.load(rows_ptr + n + z).to(tl.int64)
    return row * stride_sn + (h * stride_sh + v0 * stride_sv).to(tl.int64)


@triton.jit
def _state_tile(
    base,
    z,
    stride_sv,
    rem_v,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Pointers [BK, BV] of a state tile's transpose S^T (k down the rows) from `base` (the
    tile's S[0, 0]) and its mask (masks only where the tile passes the head dims). `z` is an
    int32 zero: built from a loop value, it keeps the pointers from being computed once and
    held in registers through the chunk loop."""
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV) + z
    ptrs = base + offs_k[:, None] + offs_v[None, :] * stride_sv
    mask = (offs_k < K)[:, None] if K < BK else (offs_v >= 0)[None, :]
    if V % BV:
        mask = mask & (offs_v < rem_v)[None, :]
    return ptrs, mask


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _gdn_chunked_kernel(
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
    ckpt_ptr,  # [N] int: tokens after which to snapshot the state (0: none; CKPT only)
    ckpt_rows_ptr,  # [N] int64: the pool row the snapshot goes to (CKPT only)
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
    BK: tl.constexpr,  # max(16, next power of two >= K): the whole key dim in one tile
    BV: tl.constexpr,  # value rows per program (>= 16)
    BT: tl.constexpr,  # tokens per chunk (a power of two >= 16)
    PRECISION: tl.constexpr,  # tl.dot input precision of the chunk's float32 products
    INV_PRECISION: tl.constexpr,  # ... of the triangular solve U = (I + A)^-1 R
    CKPT: tl.constexpr,  # the call takes in-step snapshots (ckpt_ptr / ckpt_rows_ptr read)
    INTERPRET: tl.constexpr,
):
    """Grid (N * HV * cdiv(V, BV),): one sequence's chunks through a [BK, BV] float32 tile of
    its state, transposed (S^T: the K-last pool read with k down the rows, so the state
    update K^T (w U) is a dot with 128 rows, a whole warpgroup's). Chunks are BT tokens,
    except where the checkpoint h or the sequence's end cuts one."""
    n = tl.program_id(0) // (HV * ((V + BV - 1) // BV))
    start = tl.load(starts_ptr + n)
    length = (tl.load(ends_ptr + n) - start).to(tl.int32)
    ckpt = 0  # tokens after which the snapshot is stored (0: none)
    if CKPT:
        ckpt = tl.load(ckpt_ptr + n).to(tl.int32)
        ckpt = tl.where((ckpt > 0) & (ckpt < length), ckpt, 0)  # out of range: none
    # chunks: cdiv(ckpt, BT) of the first ckpt tokens, then cdiv(length - ckpt, BT); the
    # state lives in its pool row between chunks (a sequence with none: no chunk, untouched)
    num_chunks = (ckpt + BT - 1) // BT + (length - ckpt + BT - 1) // BT
    done = 0  # tokens of the sequence behind us
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a loaded bound
        c = 0
        while c < num_chunks:
            count = tl.minimum(tl.where(done < ckpt, ckpt, length) - done, BT)
            _chunk_step(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
                starts_ptr, slots_ptr, init_ptr, ckpt_rows_ptr, out_ptr,
                stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                stride_an, stride_ah, stride_bn, stride_bh, stride_sn, stride_sh, stride_sv,
                stride_on, stride_oh, scale, done, count, done + count == ckpt,
                HV, GROUP, K, V, BK, BV, BT, PRECISION, INV_PRECISION, CKPT, INTERPRET,
            )  # fmt: skip
            done += count
            c += 1
    else:
        for _ in tl.range(0, num_chunks):
            count = tl.minimum(tl.where(done < ckpt, ckpt, length) - done, BT)
            _chunk_step(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr,
                starts_ptr, slots_ptr, init_ptr, ckpt_rows_ptr, out_ptr,
                stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                stride_an, stride_ah, stride_bn, stride_bh, stride_sn, stride_sh, stride_sv,
                stride_on, stride_oh, scale, done, count, done + count == ckpt,
                HV, GROUP, K, V, BK, BV, BT, PRECISION, INV_PRECISION, CKPT, INTERPRET,
            )  # fmt: skip
            done += count


@dataclass(frozen=True)
class ChunkedTiling:
    """How the chunked kernel cuts its work (all compile-time constants).

    chunk: tokens per chunk (BT, a power of two >= 16). block_v: value rows per program (BV,
    a power of two >= 16). num_warps / num_stages: as Triton's. precision: of the float32
    products (`_dot_f32`: "bf16x3", "tf32", "tf32x3" or "ieee"); inv_precision: of the
    triangular solve's (the error of the final state is mostly theirs).
    """

    chunk: int
    block_v: int
    num_warps: int
    num_stages: int = 1
    precision: str = "bf16x3"
    inv_precision: str = "bf16x3"

    @property
    def name(self) -> str:
        prec = f"{self.precision}-{self.inv_precision}"
        return f"bt{self.chunk}-bv{self.block_v}-w{self.num_warps}-s{self.num_stages}-{prec}"


def chunked_tiling(
    head_v_dim: int,
    head_k_dim: int,
    chunk: int | None = None,
    act_dtype: torch.dtype = torch.bfloat16,
) -> ChunkedTiling:
    """The tiling by shape, fixed (no autotuning: one plain launch is the point). Float32
    activations (a reference-precision run: the float32 parity tests) take "ieee" products,
    exact to float32 rounding at ~7x the time; 16-bit ones the bf16x3 default.

    Measured at K = V = 128 on one H200 (one run), 16 sequences x 136 tokens, bf16 in, float32
    pool: the token-by-token kernel 685 us; BT 64 / BV 64 / 4 warps (this) 289 us, with tf32
    products 270 us (final-state error 4e-4 instead of 4e-6), BT 32 413 us. An earlier build
    (state carried in registers, tf32) ran BV 64 faster than BV 32 or 128 (4 or 8 warps).
    """
    block_v = max(16, triton.next_power_of_2(head_v_dim))
    prec = "ieee" if act_dtype == torch.float32 else "bf16x3"
    if interpreting():  # CPU interpreter: fewest programs are fastest
        return ChunkedTiling(chunk or 64, block_v, 4, precision=prec, inv_precision=prec)
    return ChunkedTiling(chunk or 64, min(64, block_v), 4, precision=prec, inv_precision=prec)


def gdn_chunked_rows(
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
    ckpt_lens: torch.Tensor | None = None,
    ckpt_rows: torch.Tensor | None = None,
    chunk: int | None = None,
    *,
    tiling: ChunkedTiling | None = None,
) -> None:
    """The gated delta rule over the token rows `starts[n] .. ends[n] - 1` of each sequence n,
    in chunks, in one launch, in place on `ssm_state` and `out` (rows of no sequence are not
    written). The contract of `triton_prefill.gdn_prefill_rows`, plus checkpoints.

    Args:
        q, k: [T, HK, K] raw (un-normalised) queries and keys; v: [T, HV, V]; any row strides.
        a, b: [T, HV] raw gate inputs. A_log, dt_bias: [HV].
        ssm_state: [num_slots, HV, V, K] float32 or bfloat16 pool; the slots of the sequences
            (distinct) are read (where `has_initial_state`) and written.
        starts, ends: [N] integer token rows of each sequence (device).
        state_slots: [N] int64 pool slot per sequence. has_initial_state: [N] bool.
        out: [T, HV, V] output rows, written for the sequences' tokens in out's dtype.
        ckpt_lens, ckpt_rows: [N] integer tensors (both or neither): sequence n with
            ckpt_lens[n] = h, 0 < h < its length, also stores its state after its first h
            tokens to `ssm_state[ckpt_rows[n]]` (a row no sequence of the call uses), in the
            pool's dtype; 0 (or any h out of that range) takes none.
        chunk: tokens per chunk (a power of two >= 16); None: `chunked_tiling`'s choice.
        tiling: overrides `chunked_tiling`'s whole choice (tests, benchmarks).
    """
    num_seqs = state_slots.shape[0]
    if (ckpt_lens is None) != (ckpt_rows is None) or (
        ckpt_lens is not None and not (ckpt_lens.shape == ckpt_rows.shape == (num_seqs,))
    ):
        shapes = [None if t is None else tuple(t.shape) for t in (ckpt_lens, ckpt_rows)]
        raise ValueError(f"ckpt_lens, ckpt_rows {shapes}: want both [N={num_seqs}] or neither")
    checkpoints = (ckpt_lens, ckpt_rows) if ckpt_lens is not None else None
    check_rows_args(
        q, k, v, a, b, ssm_state, starts, ends, state_slots, has_initial_state, out, checkpoints
    )
    num_v_heads, head_v = v.shape[1:]
    num_k_heads, head_k = q.shape[1:]
    tiling = tiling or chunked_tiling(head_v, head_k, chunk, v.dtype)
    pow2 = [t >= 16 and t & (t - 1) == 0 for t in (tiling.chunk, tiling.block_v)]
    if not all(pow2):
        raise ValueError(
            f"chunk={tiling.chunk}, block_v={tiling.block_v}: want powers of two >= 16 "
            "(tl.dot's smallest tile; the chunk is solved in blocks of 16)"
        )
    if tiling.precision not in PRECISIONS or tiling.inv_precision not in PRECISIONS:
        raise ValueError(f"precisions {tiling.precision}, {tiling.inv_precision}: {PRECISIONS}")
    if num_seqs == 0:
        return
    q, k, v, out_k = (unit_last(t) for t in (q, k, v, out))
    ckpt = checkpoints if checkpoints is not None else (starts, starts)
    grid = (num_seqs * num_v_heads * triton.cdiv(head_v, tiling.block_v),)
    _gdn_chunked_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, ssm_state,
        starts, ends, state_slots, has_initial_state, *ckpt, out_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        out_k.stride(0), out_k.stride(1),
        head_k**-0.5,
        HV=num_v_heads,
        GROUP=num_v_heads // num_k_heads,
        K=head_k,
        V=head_v,
        BK=max(16, triton.next_power_of_2(head_k)),
        BV=tiling.block_v,
        BT=tiling.chunk,
        PRECISION=tiling.precision,
        INV_PRECISION=tiling.inv_precision,
        CKPT=checkpoints is not None,
        INTERPRET=interpreting(),
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )  # fmt: skip
    if out_k is not out:
        out.copy_(out_k)


class TritonChunkedGDNPrefill(GDNPrefillBackend):
    """Every prefill sequence through the chunked Triton kernel (`gdn_chunked_rows`): one
    launch per layer call, tensor-core products per chunk of tokens. It takes a step's in-step
    snapshots inside the kernel (each at a chunk boundary)."""

    name = "triton_chunked"

    def __init__(self, tiling: ChunkedTiling | None = None) -> None:
        self.tiling = tiling  # None: `chunked_tiling`'s choice (overrides: benchmarks)

    def takes_checkpoints(self, meta: PrefillMetadata) -> bool:
        return True

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
        ckpt = meta.checkpoint_tensors() or (None, None)
        gdn_chunked_rows(
            q, k, v, a, b, A_log, dt_bias, ssm_state,
            qsl[:-1], qsl[1:], meta.state_slots, meta.has_initial_state, out,
            *ckpt, tiling=self.tiling,
        )  # fmt: skip
        return out
