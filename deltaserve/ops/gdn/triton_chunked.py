"""Triton GDN prefill in chunks (tensor cores), ONE plain launch per call.

The same contract as `triton_prefill.gdn_prefill_rows` (the token-by-token kernel), with the
chunked WY / UT-transform form of the gated delta rule (the math of `deltaserve.ops.gdn`; its
torch reference, line by line, is `reference.chunk_gated_delta_rule`). Within a chunk of C
tokens from state S0 ([V, K], "K-last"), with gamma_i the cumulative log decay from the chunk
start and D_ij = exp(gamma_i - gamma_j) (j <= i):

    A   = strictly_lower(beta_i D_ij k_i . k_j)                      [C, C]
    U   = (I + A)^-1 (beta V - (beta exp(gamma) K) S0^T)             [C, V]
    O   = (exp(gamma) Q) S0^T + ((Q K^T) * D) U                      [C, V]
    S_C = exp(gamma_C) S0 + U^T (exp(gamma_C - gamma) K)            [V, K]

One program handles one (sequence n, value head h, tile of BV value rows): it carries its
[BV, K] state tile in float32 registers through the sequence's chunks of up to BT tokens, so
the launch needs no host knowledge of the row lengths (grid N * HV * cdiv(V, BV)), no
autotuner and no host sync. Per chunk every product is a `tl.dot` (q, k, v, gates loaded once
per chunk; l2norm of q and k with eps 1e-6 inside the rsqrt, q scaled by K ** -0.5,
g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), all float32). The work that does
not depend on V (k k^T, q k^T, the triangular inverse) is repeated per V tile: that is the
price of more programs (more latency hiding) than one per (sequence, head).

The unit lower-triangular inverse (I + A)^-1, A strictly lower (C = NB blocks of 16):
  1. the NB diagonal 16 x 16 blocks are inverted by forward substitution, all NB at once
     ([NB, 16, 16] tiles, 14 row steps of elementwise float32 math: exact as torch's solve);
  2. with Dg^-1 that block-diagonal inverse and E = A's strictly-block-lower part,
     (I + A)^-1 = (I + N)^-1 Dg^-1, N = Dg^-1 E, and N^NB = 0 (strictly block lower), so
     (I + A)^-1 = sum_{p < NB} (-N)^p Dg^-1, evaluated as X <- Dg^-1 - N X (NB - 1 dots).
     Its terms are exactly those of block forward substitution (fla-core's 16 -> 64 merge),
     so it is as sound; the dots of the inverse run in IEEE float32 (see `ChunkedTiling`).

Checkpoints (prefix-cache snapshots inside a row): a sequence with ckpt_lens[n] = h > 0 ends a
chunk at h (chunks of its first h tokens, then of the rest), so the state after h tokens is a
chunk boundary's, exact, and is stored to `ssm_state[ckpt_rows[n]]` from inside the loop.

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
from deltaserve.ops.gdn.triton_prefill import check_prefill_args, interpreting

PRECISIONS = ("ieee", "tf32x3", "tf32")


@triton.jit
def _unit_lower_inverse(A, BT: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 for A [BT, BT] float32 strictly lower triangular (BT a multiple of 16).

    Forward substitution on the BT / 16 diagonal 16 x 16 blocks at once, then their
    block-diagonal inverse Dg^-1 merged with the strictly-block-lower rest E of A as
    sum_{p < NB} (-N)^p Dg^-1, N = Dg^-1 E (nilpotent: N^NB = 0), by NB - 1 Horner steps.
    """
    NB: tl.constexpr = BT // 16
    blk_r = tl.arange(0, NB)[:, None, None, None]
    blk_c = tl.arange(0, NB)[None, None, :, None]
    A4 = tl.reshape(A, (NB, 16, NB, 16))  # [row block, row, col block, col]
    A3 = tl.sum(tl.where(blk_r == blk_c, A4, 0.0), axis=2)  # [NB, 16, 16] diagonal blocks
    # XT[b, c, j] = X[b, j, c] - I: the transpose of the off-diagonal part of block b's
    # inverse, rows j < i final at step i (so the sums below need no layout change)
    XT = -tl.permute(A3, (0, 2, 1))  # rows 0 and 1 of X - I are -A's: final already
    row = tl.arange(0, 16)[None, :, None]  # axis 1 of A3: its row i
    col = tl.arange(0, 16)[None, None, :]  # axis 2 of XT: X's row j
    for i in range(2, 16):
        # X[i, :] = e_i - A[i, :] - sum_j A[i, j] (X[j, :] - e_j)
        a = -tl.sum(tl.where(row == i, A3, 0.0), axis=1)  # [NB, 16]: -A[i, j] (b, j)
        x = a + tl.sum(a[:, None, :] * XT, axis=2)  # [NB, 16]: (b, c)
        XT = tl.where(col == i, x[:, :, None], XT)
    eye = tl.arange(0, 16)[:, None] == tl.arange(0, 16)[None, :]
    X3 = tl.permute(XT, (0, 2, 1)) + tl.where(eye, 1.0, 0.0)[None, :, :]  # [NB, 16, 16]
    Xd = tl.reshape(tl.where(blk_r == blk_c, X3[:, :, None, :], 0.0), (BT, BT))  # Dg^-1
    X = Xd
    if NB > 1:
        offs = tl.arange(0, BT)
        E = tl.where((offs[:, None] // 16) != (offs[None, :] // 16), A, 0.0)
        N = tl.dot(Xd, E, input_precision=PRECISION)  # [BT, BT]
        for _ in tl.static_range(NB - 1):
            X = Xd - tl.dot(N, X, input_precision=PRECISION)
    return X


@triton.jit
def _dot_act(x, y, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """x [M, R] @ y [R, N] -> float32, both in the activations' dtype: 16-bit operands multiply
    exactly (float32 accumulation); float32 ones at PRECISION."""
    if x.dtype == tl.float32:
        return tl.dot(x, y, input_precision=PRECISION)
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
        return tl.dot(x.to(tl.float32), y, acc, input_precision=PRECISION)


@triton.jit
def _chunk_step(
    St,  # [BK, BV] float32 state tile, transposed (rows k, cols v)
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    pos,  # int64: the chunk's first token row
    count,  # int32: its tokens (1 .. BT)
    hk,
    h,
    offs_t,  # [BT]
    offs_k,  # [BK]
    offs_v,  # [BV]
    mask_k,
    mask_v,
    neg_A,
    dt_bias,
    scale,
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
    stride_on,
    stride_oh,
    BT: tl.constexpr,
    PRECISION: tl.constexpr,
    INV_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One chunk of `count` tokens from row `pos`: writes its outputs [count, BV] and returns
    the state tile after it (the math of `reference.chunk_gated_delta_rule`).

    q and k enter every product raw, in their dtype (bf16 on the GPU: exact products, and
    operands that can stay in shared memory); their l2 norms and the scale are applied as
    row / column factors of the products' results (rq, rk), the same math.
    """
    valid = offs_t < count  # [BT]
    rows = pos + offs_t  # [BT] int64
    m_qk = valid[:, None] & mask_k[None, :]
    m_v = valid[:, None] & mask_v[None, :]
    q = tl.load(
        q_ptr + rows[:, None] * stride_qn + hk * stride_qh + offs_k[None, :], mask=m_qk, other=0.0
    )  # [BT, BK]
    k = tl.load(
        k_ptr + rows[:, None] * stride_kn + hk * stride_kh + offs_k[None, :], mask=m_qk, other=0.0
    )  # [BT, BK]
    v = tl.load(
        v_ptr + rows[:, None] * stride_vn + h * stride_vh + offs_v[None, :], mask=m_v, other=0.0
    ).to(tl.float32)  # [BT, BV]
    a = tl.load(a_ptr + rows * stride_an + h * stride_ah, mask=valid, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows * stride_bn + h * stride_bh, mask=valid, other=0.0).to(tl.float32)

    # gates (softplus linear past 20, as torch's); rows past the chunk: g = 0, beta = 0, k = 0
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = tl.where(valid, neg_A * softplus, 0.0)  # [BT] log decay, <= 0
    beta = tl.where(valid, 1.0 / (1.0 + tl.exp(-b)), 0.0)  # [BT]
    gamma = tl.cumsum(g, axis=0)  # [BT] log decay from the chunk start
    gamma_end = tl.sum(tl.where(offs_t == BT - 1, gamma, 0.0), axis=0)  # = the last token's
    q32 = q.to(tl.float32)
    k32 = k.to(tl.float32)
    rq = tl.rsqrt(tl.sum(q32 * q32, axis=1) + 1e-6) * scale  # [BT]: q_i = rq_i q_raw_i
    rk = tl.rsqrt(tl.sum(k32 * k32, axis=1) + 1e-6)  # [BT]

    lower = offs_t[:, None] >= offs_t[None, :]  # [BT, BT]: j <= i
    diff = gamma[:, None] - gamma[None, :]
    decay = tl.where(lower, tl.exp(tl.where(lower, diff, 0.0)), 0.0)  # D [BT, BT]
    kT = tl.trans(k)  # [BK, BT]
    kk = _dot_act(k, kT, PRECISION, INTERPRET) * (rk[:, None] * rk[None, :])  # [BT, BT]
    A = tl.where(offs_t[:, None] > offs_t[None, :], beta[:, None] * kk * decay, 0.0)
    Ainv = _unit_lower_inverse(A, BT, INV_PRECISION)  # (I + A)^-1 [BT, BT]

    eg = tl.exp(gamma)  # [BT]
    zero = tl.zeros((BT, St.shape[1]), dtype=tl.float32)
    ks = _dot_mixed(k, St, zero, PRECISION, INTERPRET)  # [BT, BV]: S0 k_raw_i
    rhs = beta[:, None] * (v - (eg * rk)[:, None] * ks)  # [BT, BV]
    u = tl.dot(Ainv, rhs, input_precision=INV_PRECISION)  # [BT, BV]: what each token writes

    qk = _dot_act(q, kT, PRECISION, INTERPRET) * (rq[:, None] * rk[None, :]) * decay
    o = _dot_mixed(q, St, zero, PRECISION, INTERPRET) * (eg * rq)[:, None]  # [BT, BV]
    o = tl.dot(qk, u, o, input_precision=PRECISION)
    o_ptrs = out_ptr + rows[:, None] * stride_on + h * stride_oh + offs_v[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_v)

    # S^T = exp(gamma_end) S^T + K^T (w U), w_i = rk_i exp(gamma_end - gamma_i)
    wu = u * (rk * tl.exp(gamma_end - gamma))[:, None]  # [BT, BV]
    return _dot_mixed(kT, wu, St * tl.exp(gamma_end), PRECISION, INTERPRET)  # [BK, BV]


@triton.jit
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
    BT: tl.constexpr,  # tokens per chunk (a multiple of 16)
    PRECISION: tl.constexpr,  # tl.dot input precision of the chunk's products
    INV_PRECISION: tl.constexpr,  # ... of the triangular inverse and of U = (I + A)^-1 R
    CKPT: tl.constexpr,  # the call takes in-step snapshots (ckpt_ptr / ckpt_rows_ptr read)
    INTERPRET: tl.constexpr,
):
    """Grid (N * HV * cdiv(V, BV),): one sequence's chunks through a [BV, BK] float32 state
    tile. Chunks are BT tokens, except where the checkpoint h or the sequence's end cuts one."""
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    pid_v = pid % NV
    pid_nh = pid // NV
    n = pid_nh // HV
    h = pid_nh % HV
    hk = h // GROUP

    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]  # [BK, BV]

    start = tl.load(starts_ptr + n).to(tl.int64)
    length = (tl.load(ends_ptr + n).to(tl.int64) - start).to(tl.int32)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    has_init = tl.load(init_ptr + n) != 0
    s_ptrs = state_ptr + slot * stride_sn + h * stride_sh
    s_ptrs = s_ptrs + offs_k[:, None] + offs_v[None, :] * stride_sv  # [BK, BV]: S^T's
    # NOTE: a masked load, not a multiply: a fresh slot's garbage (even NaN) is never read
    S = tl.load(s_ptrs, mask=mask_s & has_init, other=0.0).to(tl.float32)  # [BK, BV] = S^T
    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)

    ckpt = 0  # tokens after which the snapshot is stored (0: none)
    c_ptrs = s_ptrs
    if CKPT:
        ckpt = tl.load(ckpt_ptr + n).to(tl.int32)
        ckpt = tl.where((ckpt > 0) & (ckpt < length), ckpt, 0)  # out of range: none
        c_row = tl.load(ckpt_rows_ptr + n).to(tl.int64)
        c_ptrs = s_ptrs + (c_row - slot) * stride_sn  # the same tile of the snapshot row
    # chunks: cdiv(ckpt, BT) of the first ckpt tokens, then cdiv(length - ckpt, BT)
    num_chunks = (ckpt + BT - 1) // BT + (length - ckpt + BT - 1) // BT
    done = 0  # tokens of the sequence behind us
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a loaded bound
        c = 0
        while c < num_chunks:
            stop = tl.where(done < ckpt, ckpt, length)
            count = tl.minimum(stop - done, BT)
            S = _chunk_step(
                S, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, out_ptr, start + done, count, hk, h,
                offs_t, offs_k, offs_v, mask_k, mask_v, neg_A, dt_bias, scale,
                stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                stride_an, stride_ah, stride_bn, stride_bh, stride_on, stride_oh,
                BT, PRECISION, INV_PRECISION, INTERPRET,
            )  # fmt: skip
            done += count
            if CKPT:
                tl.store(c_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_s & (done == ckpt))
            c += 1
    else:
        for _ in tl.range(0, num_chunks):
            stop = tl.where(done < ckpt, ckpt, length)
            count = tl.minimum(stop - done, BT)
            S = _chunk_step(
                S, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, out_ptr, start + done, count, hk, h,
                offs_t, offs_k, offs_v, mask_k, mask_v, neg_A, dt_bias, scale,
                stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                stride_an, stride_ah, stride_bn, stride_bh, stride_on, stride_oh,
                BT, PRECISION, INV_PRECISION, INTERPRET,
            )  # fmt: skip
            done += count
            if CKPT:
                tl.store(c_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_s & (done == ckpt))
    # NOTE: an empty sequence leaves its slot untouched (as the reference does)
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=mask_s & (length > 0))


@dataclass(frozen=True)
class ChunkedTiling:
    """How the chunked kernel cuts its work (all compile-time constants).

    chunk: tokens per chunk (BT, a multiple of 16). block_v: value rows per program (BV).
    num_warps / num_stages: as Triton's. precision / inv_precision: tl.dot input precision
    of the chunk's products and of the triangular inverse with U = (I + A)^-1 R.
    """

    chunk: int
    block_v: int
    num_warps: int
    num_stages: int = 1
    precision: str = "tf32x3"
    inv_precision: str = "ieee"

    @property
    def name(self) -> str:
        prec = f"{self.precision}-{self.inv_precision}"
        return f"bt{self.chunk}-bv{self.block_v}-w{self.num_warps}-s{self.num_stages}-{prec}"


def chunked_tiling(head_v_dim: int, head_k_dim: int, chunk: int | None = None) -> ChunkedTiling:
    """The tiling by shape, fixed (no autotuning: one plain launch is the point)."""
    block_v_all = max(16, triton.next_power_of_2(head_v_dim))
    if interpreting():  # CPU interpreter: fewest programs and ops are fastest
        return ChunkedTiling(chunk or 32, block_v_all, 4)
    return ChunkedTiling(chunk or 64, min(32, block_v_all), 4)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is unit-stride (what the kernel's pointers assume)."""
    return t if t.stride(-1) == 1 else t.contiguous()


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
        chunk: tokens per chunk (a multiple of 16); None: `chunked_tiling`'s choice.
        tiling: overrides `chunked_tiling`'s whole choice (tests, benchmarks).
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
    if a.shape != v.shape[:2] or b.shape != v.shape[:2]:
        raise ValueError(
            f"a {tuple(a.shape)}, b {tuple(b.shape)}: want [T, HV] = {tuple(v.shape[:2])}"
        )
    if (ckpt_lens is None) != (ckpt_rows is None) or (
        ckpt_lens is not None and not (ckpt_lens.shape == ckpt_rows.shape == (num_seqs,))
    ):
        shapes = [None if t is None else tuple(t.shape) for t in (ckpt_lens, ckpt_rows)]
        raise ValueError(f"ckpt_lens, ckpt_rows {shapes}: want both [N={num_seqs}] or neither")
    num_v_heads, head_v = v.shape[1:]
    num_k_heads, head_k = q.shape[1:]
    tiling = tiling or chunked_tiling(head_v, head_k, chunk)
    if tiling.chunk < 16 or tiling.chunk % 16 or tiling.block_v < 16:
        raise ValueError(
            f"chunk={tiling.chunk}, block_v={tiling.block_v}: want a chunk that is a multiple "
            "of 16 and block_v >= 16 (tl.dot's smallest tile)"
        )
    if tiling.precision not in PRECISIONS or tiling.inv_precision not in PRECISIONS:
        raise ValueError(f"precisions {tiling.precision}, {tiling.inv_precision}: {PRECISIONS}")
    if ssm_state.stride(-1) != 1:
        raise ValueError("ssm_state's last dim must be unit-stride (updated in place)")
    if num_seqs == 0:
        return
    q, k, v, out_k = (_unit_last(t) for t in (q, k, v, out))
    ckpt = (ckpt_lens, ckpt_rows) if ckpt_lens is not None else (starts, starts)
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
        CKPT=ckpt_lens is not None,
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
        total = meta.query_start_loc_cpu[-1]  # tokens owned by the sequences (<= Tp)
        out = torch.empty_like(v, memory_format=torch.contiguous_format)
        if total < v.shape[0]:  # rows no sequence owns come back zero
            out[total:].zero_()
        qsl = meta.query_start_loc  # [P + 1]
        ckpt = meta.checkpoint_tensors() or (None, None)
        gdn_chunked_rows(
            q, k, v, a, b, A_log, dt_bias, ssm_state,
            qsl[:-1], qsl[1:], meta.state_slots, meta.has_initial_state, out,
            *ckpt, tiling=self.tiling,
        )  # fmt: skip
        return out
