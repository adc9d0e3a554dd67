"""The MoE decode path's gate_up kernel (deltaserve.ops.moe.triton_decode): per selected
expert and column tile, inter = silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T) for the slots
routed to it; optionally with H split across programs (SPLIT_K, a tuning choice: at batch 1
there are only 8 x I / BLOCK_N programs, each reducing all of H), the slices summed by the last
program of each tile (arrival counters, deltaserve.ops.tile_counters) before SiLU-and-mul; and
for one token, optionally with the routing done in each program (no routing launch)."""

from __future__ import annotations

import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.moe.triton_decode_common import (
    chunk_slots,
    gate_up_configs,
    slot_rows,
)
from deltaserve.ops.moe.triton_gemm import gate_up_partial, gate_up_tile


@triton.jit
def route_choice(
    logits_ptr,
    s,
    scale,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
):
    """One token's routing choice s (T = 1: the experts are distinct): softmax in float32 over
    its E logits, the k largest one at a time (ties to the lower id), renormalised when asked
    or (SCALE, DeepSeek-V2 greedy) times `scale`, as triton_routing computes them -> (expert id,
    float32 weight). Both decode kernels call it (the same math gives the same bits)."""
    offs_e = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + offs_e, mask=offs_e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(offs_e < E, p, -1.0)
    # one reduction gives the largest value and its index (ties to the lower id, as argmax)
    weight, chosen = tl.max(p, axis=0, return_indices=True)  # choice 0
    total = weight
    p = tl.where(offs_e == chosen, -2.0, p)
    for j in tl.static_range(1, TOP_K):
        best_p, best = tl.max(p, axis=0, return_indices=True)
        total += best_p
        chosen = tl.where(s == j, best, chosen)
        weight = tl.where(s == j, best_p, weight)
        p = tl.where(offs_e == best, -2.0, p)
    if RENORMALIZE:
        weight = weight / total
    if SCALE:  # never with RENORMALIZE
        weight = weight * scale
    return chosen, weight


@triton.jit
def _route_one_token(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    scale,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    S_PAD: tl.constexpr,
):
    """One token's routing inside gate_up (`route_choice` of slot s = program_id(0)). Program
    (s, 0, 0) stores ids[s] and weights[s] (in the weights buffer's dtype: float32 with SCALE).
    Returns what `slot_rows` returns."""
    s = tl.program_id(0)
    chosen, weight = route_choice(logits_ptr, s, scale, E, E_PAD, TOP_K, RENORMALIZE, SCALE)
    if (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
        tl.store(ids_ptr + s, chosen.to(ids_ptr.dtype.element_ty))
        tl.store(weights_ptr + s, weight.to(weights_ptr.dtype.element_ty))
    offs = tl.arange(0, S_PAD)
    mine = offs == s
    return 0, chosen.to(tl.int64), mine, tl.zeros((S_PAD,), dtype=tl.int32), 1


@autotune(configs=gate_up_configs(), key=["S_PAD", "ROWS", "H", "INTER", "ROUTE"])
@triton.jit
def _decode_gate_up_kernel(
    x_ptr,
    w13_ptr,
    inter_ptr,
    ids_ptr,
    ws_ptr,
    cnt_ptr,
    logits_ptr,
    weights_ptr,
    num_pairs,
    stride_x,
    stride_we,
    stride_wn,
    stride_i,
    route_scale,
    TOP_K: tl.constexpr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    S_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    ROUTE: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Grid (S pair slots, cdiv(I, BLOCK_N), SPLIT_K). With SPLIT_K > 1 each program reduces
    one K slice of H into float32 gate / up partials (ws [SPLIT_K, S, 2I]); the last of a
    (slot, column tile) to arrive (counters [S, cdiv(I, 16)]) sums them in slice order, applies
    SiLU-and-mul, writes inter and resets its counter. With ROUTE (one token) each program
    routes the token's E router logits itself and stores the routing for the down kernel
    (with SCALE, DeepSeek-V2's greedy rule: weights times `route_scale`, float32)."""
    pdl.wait(PDL)  # its experts depend on the routing: nothing to load before (ops/pdl.py)
    if ROUTE:
        earlier, e, mine, place, count = _route_one_token(
            logits_ptr, ids_ptr, weights_ptr, route_scale, E, E_PAD, TOP_K, RENORMALIZE, SCALE,
            S_PAD,
        )  # fmt: skip
    else:
        earlier, e, mine, place, count = slot_rows(ids_ptr, num_pairs, S_PAD)
    if earlier == 0:  # else another program streams this expert
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        w_ptr = w13_ptr + e * stride_we
        if SPLIT_K == 1:
            r0 = 0
            while r0 < count:  # one pass for up to ROWS slots (all of them at decode sizes)
                slots, valid = chunk_slots(mine, place, r0, ROWS, S_PAD)
                h = gate_up_tile(
                    x_ptr, stride_x, slots // TOP_K, valid, w_ptr, stride_wn, offs_n, n_mask,
                    H, INTER, ROWS, BLOCK_N, BLOCK_K, PRECISION,
                )  # fmt: skip
                out = inter_ptr + slots[:, None] * stride_i + offs_n[None, :]
                mask = valid[:, None] & n_mask[None, :]
                tl.store(out, h.to(inter_ptr.dtype.element_ty), mask=mask)
                r0 += ROWS
        else:
            K_SPLIT: tl.constexpr = (H + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K) * BLOCK_K
            pid_k = tl.program_id(2)
            r0 = 0
            while r0 < count:  # every pass's partials first, then one arrival
                slots, valid = chunk_slots(mine, place, r0, ROWS, S_PAD)
                g, u = gate_up_partial(
                    x_ptr, stride_x, slots // TOP_K, valid, w_ptr, stride_wn, offs_n, n_mask,
                    pid_k * K_SPLIT, H, INTER, K_SPLIT, ROWS, BLOCK_N, BLOCK_K, PRECISION,
                )  # fmt: skip
                ws = ws_ptr + ((pid_k * num_pairs + slots) * 2 * INTER)[:, None] + offs_n[None, :]
                mask = valid[:, None] & n_mask[None, :]
                tl.store(ws, g, mask=mask)
                tl.store(ws + INTER, u, mask=mask)
                r0 += ROWS
            # NOTE: every thread's partials are stored before the (single-thread) release
            tl.debug_barrier()
            tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last slice of this tile: finish it
                r0 = 0
                while r0 < count:
                    slots, valid = chunk_slots(mine, place, r0, ROWS, S_PAD)
                    mask = valid[:, None] & n_mask[None, :]
                    g = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
                    u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
                    for j in tl.static_range(SPLIT_K):
                        row = ((j * num_pairs + slots) * 2 * INTER)[:, None] + offs_n[None, :]
                        g += tl.load(ws_ptr + row, mask=mask, other=0.0, cache_modifier=".cg")
                        u += tl.load(
                            ws_ptr + row + INTER, mask=mask, other=0.0, cache_modifier=".cg"
                        )
                    h = g * tl.sigmoid(g) * u
                    out = inter_ptr + slots[:, None] * stride_i + offs_n[None, :]
                    tl.store(out, h.to(inter_ptr.dtype.element_ty), mask=mask)
                    r0 += ROWS
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call
