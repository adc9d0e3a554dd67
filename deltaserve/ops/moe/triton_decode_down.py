"""The MoE decode path's down kernel (deltaserve.ops.moe.triton_decode): per selected expert
and column tile, the routing-weighted down projection of its slots' intermediates; SHARED_SPLITS
more rows of programs for the block's shared expert (its SiLU-and-mul on the tiles it loads),
each over one K range of its intermediate; and, when asked, each token's sum over its rows by the
last program of each column tile.

Why split the shared expert: every program of a column tile streams one expert's [BLOCK_N, I]
down slice, and the step lasts as long as its slowest program. DeepSeek-V2's shared experts are
one MLP of n_shared x the routed width (2816 against 1408 on V2-Lite), so one program row for
it would stream twice a routed program's bytes; split in K, its rows cost what a routed row
costs and their partial outputs are summed with the rest."""

from __future__ import annotations

import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.moe.triton_decode_common import (
    DOWN_EXTRA,
    chunk_slots,
    decode_configs,
    slot_rows,
)
from deltaserve.ops.moe.triton_gemm import down_tile


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
    split,
    H: tl.constexpr,
    SHARED_INTER: tl.constexpr,
    SHARED_SPLITS: tl.constexpr,
    HAS_GATE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Part `split` of the shared expert's down projection for every token, BLOCK_N output
    columns: pair_out[num_pairs + split * T + t] = sigmoid(gate[t]) * (silu(g[t]) * u[t])[ks]
    @ w_sd[n, ks].T (float32) over K range ks, the split's share of SHARED_INTER (in steps of
    BLOCK_K), where y [T, 2 SHARED_INTER] holds [g | u] (its SiLU-and-mul is done on the tile as
    it is loaded, rounded to the activation dtype as `silu_and_mul` rounds it)."""
    dtype = wsd_ptr.dtype.element_ty
    w_rows = wsd_ptr + offs_n[:, None].to(tl.int64) * stride_sdn
    steps = tl.cdiv(tl.cdiv(SHARED_INTER, BLOCK_K), SHARED_SPLITS)  # K steps per split
    k_lo = split * steps * BLOCK_K
    k_hi = tl.minimum(k_lo + steps * BLOCK_K, SHARED_INTER)
    r0 = 0
    while r0 < num_tokens:
        tok = r0 + tl.arange(0, ROWS)
        valid = tok < num_tokens
        a_rows = y_ptr + tok[:, None].to(tl.int64) * stride_y
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        k0 = k_lo
        while k0 < k_hi:  # NOTE: a while loop: the interpreter takes no range over runtime bounds
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < k_hi
            a_mask = valid[:, None] & k_mask[None, :]
            g = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
            u = tl.load(a_rows + SHARED_INTER + k[None, :], mask=a_mask, other=0.0)
            act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            a = (act * u.to(tl.float32)).to(dtype)
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
            k0 += BLOCK_K
        if HAS_GATE:
            gl = tl.load(gate_ptr + tok.to(tl.int64) * stride_gate, mask=valid, other=0.0)
            acc = acc * tl.sigmoid(gl.to(tl.float32))[:, None]
        row = num_pairs + split * num_tokens + tok[:, None]
        out = pair_out_ptr + row.to(tl.int64) * H + offs_n[None, :]
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
    SHARED_SPLITS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[t, n] = sum_j pair_out[t * k + j, n] (+ the gated shared rows pair_out[num_pairs +
    s * T + t, n], s < SHARED_SPLITS) for every token, in float32, in choice order then the
    shared rows (the order of `triton_reduce` for one split), rounded once."""
    r0 = 0
    while r0 < num_tokens:
        tok = (r0 + tl.arange(0, ROWS)).to(tl.int64)
        mask = (tok < num_tokens)[:, None] & n_mask[None, :]
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            rows = (tok * TOP_K + j)[:, None] * H + offs_n[None, :]
            acc += tl.load(pair_out_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_SHARED:
            shared = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
            for sp in tl.static_range(SHARED_SPLITS):
                rows = (num_pairs + sp * num_tokens + tok)[:, None] * H + offs_n[None, :]
                shared += tl.load(pair_out_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg")
            acc += shared
        out = out_ptr + tok[:, None] * H + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
        r0 += ROWS


@autotune(
    configs=decode_configs(DOWN_EXTRA),
    key=["S_PAD", "ROWS", "H", "INTER", "HAS_SHARED", "SHARED_SPLITS", "SUM"],
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
    SHARED_SPLITS: tl.constexpr,
    HAS_GATE: tl.constexpr,
    SUM: tl.constexpr,
    TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pdl.wait(PDL)  # its experts depend on the routing: nothing to load before (ops/pdl.py)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    if tl.program_id(0) < num_pairs:
        earlier, e, mine, place, count = slot_rows(ids_ptr, num_pairs, S_PAD)
        if earlier == 0:  # else another program streams this expert
            r0 = 0
            while r0 < count:
                slots, valid = chunk_slots(mine, place, r0, ROWS, S_PAD)
                acc = down_tile(
                    inter_ptr, stride_i, slots, valid, w2_ptr + e * stride_we, stride_wn,
                    offs_n, n_mask, INTER, ROWS, BLOCK_N, BLOCK_K, PRECISION,
                )  # fmt: skip
                w = tl.load(weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)
                out = pair_out_ptr + slots[:, None] * H + offs_n[None, :]
                tl.store(out, acc * w[:, None], mask=valid[:, None] & n_mask[None, :])
                r0 += ROWS
    elif HAS_SHARED:  # the last SHARED_SPLITS rows of programs: the shared expert
        # NOTE: K steps of at most 128 here: its SiLU-and-mul holds two [ROWS, K step] float32
        # tiles, which at the routed branch's 512 would spill (ptxas, sm_90)
        _shared_down_rows(
            y_ptr, stride_y, gate_ptr, stride_gate, wsd_ptr, stride_sdn, pair_out_ptr,
            num_pairs, num_tokens, offs_n, n_mask, tl.program_id(0) - num_pairs, H,
            SHARED_INTER, SHARED_SPLITS, HAS_GATE, ROWS, BLOCK_N,
            128 if BLOCK_K > 128 else BLOCK_K, PRECISION,
        )  # fmt: skip
    if SUM:  # the last program of this column tile sums every token's rows
        # NOTE: every thread's stores are issued before the (single-thread) release below
        tl.debug_barrier()
        parts = num_pairs + SHARED_SPLITS if HAS_SHARED else num_pairs
        arrived = tl.atomic_add(cnt_ptr + tl.program_id(1), 1, sem="acq_rel", scope="gpu")
        if arrived == parts - 1:
            _sum_rows(pair_out_ptr, out_ptr, num_pairs, num_tokens, offs_n, n_mask, H,
                      TOP_K, HAS_SHARED, SHARED_SPLITS, ROWS, BLOCK_N)  # fmt: skip
            tl.atomic_xchg(cnt_ptr + tl.program_id(1), 0)  # ready for the next call
