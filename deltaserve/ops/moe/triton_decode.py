"""The decode path of the Triton `moe` backend: few pairs (T * k <= a threshold), no sort.

Goal: memory bandwidth. Each selected expert's weights are read once per step. The grid is
(S = T * k pair slots, column tiles), fixed by the shapes (CUDA-graph safe). The program of slot
s reads all S expert ids (a few bytes) and returns at once unless s is the first slot of its
expert; that program compacts the slots routed to the same expert into a tile of ROWS rows
(ROWS = T rounded up to a power of two in 16..64: with a top-k routing an expert has at most T
slots; more take further passes) and streams that expert's weight tile once for all of them:
- gate_up: inter[s] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T), t = s // k;
- down: pair_out[s] = topk_weight[s] * (inter[s] @ w2[e].T), float32.
With the block's shared expert given (its gate/up projection's outputs and its down weight), the
down kernel's grid has one more row of programs, which does the shared expert's SiLU-and-mul on
the tiles it loads and its down projection, gated by sigmoid(shared gate logit), into T more
rows of pair_out: the shared expert costs no launches of its own (at batch 1 it saved a
SiLU-and-mul and a decode GEMM launch per MoE layer).
The token sum is `triton_reduce.reduce_pairs`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltaserve import env
from deltaserve.ops.moe.triton_gemm import (
    dot_precision,
    down_tile,
    gate_up_tile,
    interpreting,
)
from deltaserve.ops.tile_counters import arrival_counters

# the most pairs (T * k) the decode path can serve (64 tokens at top-8), and the most the backend
# sends it by default (16 tokens at top-8; a guess until `bench kernels --only moe` decides)
DECODE_MAX_PAIRS = 512
DECODE_DEFAULT_PAIRS = 128


# (BLOCK_N, BLOCK_K, num_warps, num_stages) the decode kernels' autotuner chooses from on the
# GPU (per S_PAD, ROWS, H, INTER). BASE is the original list. At 8 pairs (batch 1, top-8) the
# grid is only 8 x cdiv(I, BLOCK_N) programs for gate_up (256 at I = 512, BLOCK_N 16) and
# 8 x cdiv(H, BLOCK_N) for down, so the bytes each program keeps in flight decide the rate:
# the additions are 2-warp variants (more programs resident per SM), deeper pipelines over
# gate_up's long H reduction, and for down (a short reduction over I) whole-I tiles in one or
# two loads. The tuner measures every entry, so an addition that does not pay is never chosen;
# DELTASERVE_MOE_DECODE_CONFIGS=base restricts it to BASE (the configuration before them).
BASE = (
    (16, 128, 4, 4),
    (16, 256, 4, 3),
    (32, 128, 4, 4),
    (32, 256, 4, 3),
    (32, 64, 4, 6),
    (64, 128, 4, 3),
    (64, 64, 4, 4),
    (16, 512, 4, 2),
)
GATE_UP_EXTRA = ((16, 128, 2, 6), (16, 256, 2, 4), (16, 64, 2, 8), (32, 128, 4, 5))
DOWN_EXTRA = ((16, 512, 2, 1), (32, 512, 4, 2), (64, 256, 4, 2), (16, 256, 2, 2))


def _decode_configs(extra: tuple[tuple[int, int, int, int], ...]) -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    table = BASE if env.moe_decode_configs() == "base" else BASE + extra
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in table
    ]


@triton.jit
def _slot_rows(ids_ptr, num_pairs, S_PAD: tl.constexpr):
    """(the slots before s routed to s's expert (0: s is its first), that expert's id as
    int64, the mask of all slots routed to it [S_PAD], its running count - 1 [S_PAD], the
    number of slots routed to it)."""
    s = tl.program_id(0)
    offs = tl.arange(0, S_PAD)
    in_range = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    e = tl.load(ids_ptr + s)
    mine = in_range & (ids == e)
    earlier = tl.sum(((offs < s) & mine).to(tl.int32), axis=0)
    place = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    return earlier, e.to(tl.int64), mine, place, tl.sum(mine.to(tl.int32), axis=0)


@triton.jit
def _chunk_slots(mine, place, r0, ROWS: tl.constexpr, S_PAD: tl.constexpr):
    """The slots of rows r0 .. r0 + ROWS - 1 of this expert, compacted: (slot ids [ROWS] int64,
    valid [ROWS]). Row r is the slot whose running count - 1 is r."""
    want = r0 + tl.arange(0, ROWS)
    hit = mine[None, :] & (place[None, :] == want[:, None])  # [ROWS, S_PAD]
    slots = tl.sum(tl.where(hit, tl.arange(0, S_PAD)[None, :], 0), axis=1)
    return slots.to(tl.int64), tl.sum(hit.to(tl.int32), axis=1) > 0


@triton.autotune(configs=_decode_configs(GATE_UP_EXTRA), key=["S_PAD", "ROWS", "H", "INTER"])
@triton.jit
def _decode_gate_up_kernel(
    x_ptr,
    w13_ptr,
    inter_ptr,
    ids_ptr,
    num_pairs,
    stride_x,
    stride_we,
    stride_wn,
    stride_i,
    TOP_K: tl.constexpr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    S_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    earlier, e, mine, place, count = _slot_rows(ids_ptr, num_pairs, S_PAD)
    if earlier > 0:  # another program streams this expert
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    r0 = 0
    while r0 < count:  # one pass for up to ROWS slots (all of them at decode sizes)
        slots, valid = _chunk_slots(mine, place, r0, ROWS, S_PAD)
        h = gate_up_tile(
            x_ptr, stride_x, slots // TOP_K, valid, w13_ptr + e * stride_we, stride_wn,
            offs_n, n_mask, H, INTER, ROWS, BLOCK_N, BLOCK_K, PRECISION,
        )  # fmt: skip
        out = inter_ptr + slots[:, None] * stride_i + offs_n[None, :]
        tl.store(out, h.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])
        r0 += ROWS


@triton.jit
def _shared_down_rows(
    y_ptr,
    stride_y,
    gate_ptr,
    stride_gate,
    wsd_ptr,
    stride_sdn,
    pair_out_ptr,
    num_pairs,
    num_tokens,
    offs_n,
    n_mask,
    H: tl.constexpr,
    SHARED_INTER: tl.constexpr,
    HAS_GATE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The shared expert's down projection for every token, BLOCK_N output columns:
    pair_out[num_pairs + t] = sigmoid(gate[t]) * (silu(g[t]) * u[t]) @ w_sd[n].T (float32),
    where y [T, 2 SHARED_INTER] holds [g | u] (its SiLU-and-mul is done on the tile as it is
    loaded, rounded to the activation dtype as `silu_and_mul` rounds it)."""
    dtype = wsd_ptr.dtype.element_ty
    w_rows = wsd_ptr + offs_n[:, None].to(tl.int64) * stride_sdn
    r0 = 0
    while r0 < num_tokens:
        tok = r0 + tl.arange(0, ROWS)
        valid = tok < num_tokens
        a_rows = y_ptr + tok[:, None].to(tl.int64) * stride_y
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, SHARED_INTER, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < SHARED_INTER
            a_mask = valid[:, None] & k_mask[None, :]
            g = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
            u = tl.load(a_rows + SHARED_INTER + k[None, :], mask=a_mask, other=0.0)
            act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            a = (act * u.to(tl.float32)).to(dtype)
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        if HAS_GATE:
            gl = tl.load(gate_ptr + tok.to(tl.int64) * stride_gate, mask=valid, other=0.0)
            acc = acc * tl.sigmoid(gl.to(tl.float32))[:, None]
        out = pair_out_ptr + (num_pairs + tok[:, None]).to(tl.int64) * H + offs_n[None, :]
        tl.store(out, acc, mask=valid[:, None] & n_mask[None, :])
        r0 += ROWS


@triton.jit
def _sum_rows(
    pair_out_ptr,
    out_ptr,
    num_pairs,
    num_tokens,
    offs_n,
    n_mask,
    H: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[t, n] = sum_j pair_out[t * k + j, n] (+ pair_out[num_pairs + t, n], the gated shared
    row) for every token, in float32, in choice order then the shared row (the order of
    `triton_reduce`), rounded once."""
    r0 = 0
    while r0 < num_tokens:
        tok = (r0 + tl.arange(0, ROWS)).to(tl.int64)
        mask = (tok < num_tokens)[:, None] & n_mask[None, :]
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            rows = (tok * TOP_K + j)[:, None] * H + offs_n[None, :]
            acc += tl.load(pair_out_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_SHARED:
            rows = (num_pairs + tok)[:, None] * H + offs_n[None, :]
            acc += tl.load(pair_out_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg")
        out = out_ptr + tok[:, None] * H + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
        r0 += ROWS


@triton.autotune(
    configs=_decode_configs(DOWN_EXTRA),
    key=["S_PAD", "ROWS", "H", "INTER", "HAS_SHARED", "SUM"],
)
@triton.jit
def _decode_down_kernel(
    inter_ptr,
    w2_ptr,
    weights_ptr,
    pair_out_ptr,
    ids_ptr,
    num_pairs,
    stride_i,
    stride_we,
    stride_wn,
    y_ptr,
    stride_y,
    gate_ptr,
    stride_gate,
    wsd_ptr,
    stride_sdn,
    num_tokens,
    out_ptr,
    cnt_ptr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    S_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    SHARED_INTER: tl.constexpr,
    HAS_GATE: tl.constexpr,
    SUM: tl.constexpr,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    if tl.program_id(0) < num_pairs:
        earlier, e, mine, place, count = _slot_rows(ids_ptr, num_pairs, S_PAD)
        if earlier == 0:  # else another program streams this expert
            r0 = 0
            while r0 < count:
                slots, valid = _chunk_slots(mine, place, r0, ROWS, S_PAD)
                acc = down_tile(
                    inter_ptr, stride_i, slots, valid, w2_ptr + e * stride_we, stride_wn,
                    offs_n, n_mask, INTER, ROWS, BLOCK_N, BLOCK_K, PRECISION,
                )  # fmt: skip
                w = tl.load(weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)
                out = pair_out_ptr + slots[:, None] * H + offs_n[None, :]
                tl.store(out, acc * w[:, None], mask=valid[:, None] & n_mask[None, :])
                r0 += ROWS
    elif HAS_SHARED:  # the last row of programs: the shared expert
        # NOTE: K steps of at most 128 here: its SiLU-and-mul holds two [ROWS, K step] float32
        # tiles, which at the routed branch's 512 would spill (ptxas, sm_90)
        _shared_down_rows(
            y_ptr, stride_y, gate_ptr, stride_gate, wsd_ptr, stride_sdn, pair_out_ptr,
            num_pairs, num_tokens, offs_n, n_mask, H, SHARED_INTER, HAS_GATE, ROWS, BLOCK_N,
            128 if BLOCK_K > 128 else BLOCK_K, PRECISION,
        )  # fmt: skip
    if SUM:  # the last program of this column tile sums every token's rows
        # NOTE: every thread's stores are issued before the (single-thread) release below
        tl.debug_barrier()
        parts = num_pairs + 1 if HAS_SHARED else num_pairs
        arrived = tl.atomic_add(cnt_ptr + tl.program_id(1), 1, sem="acq_rel", scope="gpu")
        if arrived == parts - 1:
            _sum_rows(pair_out_ptr, out_ptr, num_pairs, num_tokens, offs_n, n_mask, H,
                      TOP_K, HAS_SHARED, ROWS, BLOCK_N)  # fmt: skip
            tl.atomic_xchg(cnt_ptr + tl.program_id(1), 0)  # ready for the next call


def decode_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: SharedExpertArgs | None = None,
    sum_tokens: bool = False,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids / topk_weights [T, k] contiguous,
    T * k <= DECODE_MAX_PAIRS -> pair outputs [T * k, H] float32 (weighted, not yet summed).

    With `shared` (the shared expert: gate_up [T, 2Is], down [H, Is], gate [T, 1] or None,
    checked by the caller) the result is [T * k + T, H]: row T * k + t holds token t's shared
    expert output times sigmoid(gate[t]), computed by one more row of the down kernel's
    programs (the shared down weight streamed beside the routed experts').

    With `sum_tokens` the result is the op's output instead, [T, H] in x's dtype: each token's
    k rows (and its shared row) summed in float32 by the last program of each column tile of
    the down kernel (an arrival counter per tile, deltaserve.ops.tile_counters), in the order
    `triton_reduce` sums them: no reduce launch."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs > DECODE_MAX_PAIRS:
        raise ValueError(
            f"the decode path serves at most {DECODE_MAX_PAIRS} pairs, got {num_pairs}"
        )
    _, two_i, hidden = w13.shape
    inter_size = two_i // 2
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    out_rows = num_pairs + (num_tokens if shared is not None else 0)
    pair_out = torch.empty(out_rows, hidden, dtype=torch.float32, device=x.device)
    s_pad = max(16, triton.next_power_of_2(num_pairs))
    # slots per expert: at most T with a top-k routing (distinct experts per token); more (a
    # given routing that repeats an expert within a token) take further passes
    rows = min(64, max(16, triton.next_power_of_2(num_tokens)))
    precision = dot_precision(x.dtype)
    _decode_gate_up_kernel[lambda m: (num_pairs, triton.cdiv(inter_size, m["BLOCK_N"]))](
        x, w13, inter, topk_ids, num_pairs, x.stride(0), w13.stride(0), w13.stride(1),
        inter.stride(0), TOP_K=top_k, H=hidden, INTER=inter_size, S_PAD=s_pad, ROWS=rows,
        PRECISION=precision,
    )  # fmt: skip
    if shared is None:  # dummy pointers, never read
        y, gate, wsd, shared_inter = x, x, w2, 16
    else:
        y, wsd, gate = shared.gate_up, shared.down, shared.gate
        shared_inter = wsd.shape[1]
    out, counters = pair_out, pair_out  # dummies unless summing
    if sum_tokens:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
        # one counter per column tile of the smallest BLOCK_N the tuner may pick (16)
        counters = arrival_counters("moe-decode-down", w2, triton.cdiv(hidden, 16))
    programs = num_pairs + (1 if shared is not None else 0)
    _decode_down_kernel[lambda m: (programs, triton.cdiv(hidden, m["BLOCK_N"]))](
        inter, w2, topk_weights, pair_out, topk_ids, num_pairs, inter.stride(0), w2.stride(0),
        w2.stride(1), y, y.stride(0), gate if gate is not None else y,
        gate.stride(0) if gate is not None else 0, wsd, wsd.stride(0), num_tokens, out,
        counters, H=hidden, INTER=inter_size, S_PAD=s_pad, ROWS=rows,
        HAS_SHARED=shared is not None, SHARED_INTER=shared_inter,
        HAS_GATE=gate is not None and shared is not None, SUM=sum_tokens, TOP_K=top_k,
        PRECISION=precision,
    )  # fmt: skip
    return out


class SharedExpertArgs(NamedTuple):
    """The shared expert as the decode path takes it: gate_up [T, 2Is] (x's dtype, unit last
    stride), down [H, Is] (unit last stride), gate [T, 1] (its gate logit) or None."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate: torch.Tensor | None
