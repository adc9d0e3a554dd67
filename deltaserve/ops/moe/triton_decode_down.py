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
from deltaserve.ops.moe.triton_decode_gate_up import route_choice
from deltaserve.ops.moe.triton_gemm import down_tile


@triton.jit
def _shared_act(y, ks, mask, SHARED_INTER: tl.constexpr, dtype: tl.constexpr):
    """The shared expert's activation silu(g) * u at offsets `ks` of y = [g | u] (row pointers
    already applied), in `dtype`, rounded as `silu_and_mul` rounds it (silu(g) to dtype first)."""
    g = tl.load(y + ks, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y + SHARED_INTER + ks, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (act * u.to(tl.float32)).to(dtype)


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
            a = _shared_act(a_rows, k[None, :], a_mask, SHARED_INTER, dtype)
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


@triton.jit
def _one_token_row(
    inter_ptr,
    stride_i,
    w2_ptr,
    stride_we,
    stride_wn,
    weights_ptr,
    pair_out_ptr,
    y_ptr,
    gate_ptr,
    wsd_ptr,
    stride_sdn,
    logits_ptr,
    route_scale,
    num_pairs,
    offs_n,
    n_mask,
    H: tl.constexpr,
    INTER: tl.constexpr,
    SHARED_INTER: tl.constexpr,
    SHARED_SPLITS: tl.constexpr,
    HAS_GATE: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Row r = program_id(0) of the grid for ONE token routed from its router logits (ROUTE):
    r < num_pairs is its r-th choice (`route_choice`, the gate_up kernel's math), else part
    r - num_pairs of the shared expert. The router logits were written before the gate_up
    kernel ran, so the row learns its expert and loads the first BLOCK_K columns of its down
    weights before waiting on gate_up (ops/pdl.py: the weights stream while gate_up finishes);
    the rest after. One row of activations: CUDA-core FMAs, float32."""
    r = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    dtype = w2_ptr.dtype.element_ty
    if r < num_pairs:
        e, weight = route_choice(logits_ptr, r, route_scale, E, E_PAD, TOP_K, RENORMALIZE, SCALE)
        w_rows = w2_ptr + e.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        w_mask = n_mask[:, None] & (offs_k < INTER)[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
        pdl.wait(PDL)
        a_row = inter_ptr + r.to(tl.int64) * stride_i
        a = tl.load(a_row + offs_k, mask=offs_k < INTER, other=0.0)
        acc = tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
        for k0 in tl.static_range(BLOCK_K, INTER, BLOCK_K):
            k = k0 + offs_k
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < INTER)[None, :], other=0.0)
            a = tl.load(a_row + k, mask=k < INTER, other=0.0)
            acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
        # the weight as the buffer gate_up stores holds it (the unrouted path reads that)
        acc = acc * weight.to(weights_ptr.dtype.element_ty).to(tl.float32)
    else:  # the shared expert's part r - num_pairs of its K range, split as _shared_down_rows
        steps = tl.cdiv(tl.cdiv(SHARED_INTER, BLOCK_K), SHARED_SPLITS)  # K steps per split
        k_first = (r - num_pairs) * steps * BLOCK_K
        k_hi = tl.minimum(k_first + steps * BLOCK_K, SHARED_INTER)
        w_rows = wsd_ptr + offs_n[:, None].to(tl.int64) * stride_sdn
        k = k_first + offs_k
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < k_hi)[None, :], other=0.0)
        pdl.wait(PDL)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        k_lo = k_first
        while k_lo < k_hi:  # NOTE: a while loop: the interpreter takes no range over runtime bounds
            k = k_lo + offs_k
            k_mask = k < k_hi
            if k_lo > k_first:  # the first tile was loaded before the wait
                w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            a = _shared_act(y_ptr, k, k_mask, SHARED_INTER, dtype)
            acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
            k_lo += BLOCK_K
        if HAS_GATE:
            acc = acc * tl.sigmoid(tl.load(gate_ptr).to(tl.float32))
    tl.store(pair_out_ptr + r.to(tl.int64) * H + offs_n, acc, mask=n_mask)


@autotune(
    configs=decode_configs(DOWN_EXTRA),
    key=["S_PAD", "ROWS", "H", "INTER", "HAS_SHARED", "SHARED_SPLITS", "SUM", "ROUTE"],
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
    logits_ptr,
    route_scale,
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
    ROUTE: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    if ROUTE:  # one token: each row routes it and loads its weights before the wait
        _one_token_row(
            inter_ptr, stride_i, w2_ptr, stride_we, stride_wn, weights_ptr, pair_out_ptr, y_ptr,
            gate_ptr, wsd_ptr, stride_sdn, logits_ptr, route_scale, num_pairs, offs_n, n_mask,
            H, INTER, SHARED_INTER, SHARED_SPLITS, HAS_GATE, E, E_PAD, TOP_K, RENORMALIZE,
            SCALE, PDL, BLOCK_N, BLOCK_K,
        )  # fmt: skip
    elif tl.program_id(0) < num_pairs:
        pdl.wait(PDL)  # the routing decides every load: nothing to load before (ops/pdl.py)
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
        pdl.wait(PDL)
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
