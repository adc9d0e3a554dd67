"""The MoE decode path for ONE token routed from its router logits (batch-1 decode steps): two
GEMV-style kernels beside the tile kernels of triton_decode_gate_up / triton_decode_down.

Why: at one token an MoE layer is a pure stream of the selected experts' weights, and on the
35B-A3B's narrow experts (8 x 6.3 MB a layer, width 512) the tile kernels lost time to their
floor (profile of a step before this: gate_up 13.7 us against 8.0 at the copy rate, down 11.2
against 4.5): a tensor-core dot whose other 15 rows are padding behind small K tiles, and float32
pair rows that the down kernel's last program per column tile sums again. Here, as in the dense
one-row GEMV (ops/linear/triton_gemv.py), each program owns a few output columns and walks K in
large chunks with CUDA-core FMAs, the next chunk's loads issued before the current chunk's math
(two in flight):
- gate_up, grid (k, cdiv(I, BLOCK_N)): program (s, n) routes the token (`route_choice`, the tile
  kernel's math: the same ids and weights), streams the BLOCK_N gate rows and BLOCK_N up rows of
  expert s's w13 over H and writes inter[s, n] = silu(g) * u in x's dtype; program (s, 0) stores
  the routing (ids, weights) as the tile kernel does.
- down, grid (cdiv(H, BLOCK_N), SPLIT): the token's weight sequence for output columns n (its
  experts' w2 columns in choice order, then the shared expert's down columns) is one run of
  K chunks, cut into SPLIT runs (a tuning choice: 1, 2 or 4), each program accumulating
  weight_j * (inter[j] . w2[e_j, n, chunk]) and sigmoid(gate) * (act . w_sd[n, chunk]) in
  float32. One run writes the output (rounded once into x's dtype); with several, each writes
  a float32 partial and the last to arrive (an arrival counter per column tile) sums them in run
  order. The routing is known before the PDL wait (the router logits are written two kernels
  earlier), so each program's first two chunks of weights stream while gate_up finishes.
The result equals the tile path's within float32 rounding (each chunk weighted on its own).

Measured (one H100, docs/benchmarks.md "One token: GEMV-style kernels"): faster on the 35B-A3B
(decode batch 1 323.4 against 315.6 tok/s), slower on V2-Lite's wide experts (width 1408:
365.0 against 369.5), whose tile grid of one program row per expert already streams near the
copy rate; so the backend runs this pair for experts of width <= 512 (triton_backend.py,
DELTASERVE_MOE_ONE_TOKEN=gemv|tile forces either).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.moe.triton_decode_gate_up import route_choice
from deltaserve.ops.moe.triton_gemm import interpreting
from deltaserve.ops.tile_counters import arrival_counters

# (BLOCK_N, CHUNK_K, num_warps): at most 64 weight elements per thread in each chunk (gate_up
# loads two tiles, gate and up, per chunk: 2 * BLOCK_N * CHUNK_K / (32 * warps) <= 64)
GATE_UP_CONFIGS = (
    (2, 1024, 2),
    (4, 512, 2),
    (4, 1024, 4),
    (8, 512, 4),
    (8, 1024, 8),
    (2, 2048, 4),
    (16, 256, 4),
)
DOWN_CONFIGS = (
    (4, 512, 1),
    (8, 512, 2),
    (4, 1024, 2),
    (8, 1024, 8),
    (8, 256, 1),
    (2, 1024, 1),
    (16, 1024, 8),
)
# the down kernel's runs per column tile (SPLIT): 1 (no partials) or cut into 2 / 4 runs, each
# entry of DOWN_CONFIGS with each
DOWN_SPLITS = (1, 2, 4)
SPLIT_MAX = 4  # the partials' workspace is sized for it


def _configs(table: tuple[tuple[int, int, int], ...]) -> list[triton.Config]:
    """The tuner's list on a GPU (num_stages 1: the kernels prefetch by hand); one small
    configuration under the interpreter."""
    if interpreting():
        return [triton.Config({"BLOCK_N": 4, "CHUNK_K": 32}, num_warps=1, num_stages=1)]
    return [
        triton.Config({"BLOCK_N": bn, "CHUNK_K": ck}, num_warps=w, num_stages=1)
        for bn, ck, w in table
    ]


def _down_configs() -> list[triton.Config]:
    """DOWN_CONFIGS x DOWN_SPLITS (one small unsplit configuration under the interpreter)."""
    if interpreting():
        meta = {"BLOCK_N": 4, "CHUNK_K": 32, "SPLIT": 1}
        return [triton.Config(meta, num_warps=1, num_stages=1)]
    return [
        triton.Config({"BLOCK_N": bn, "CHUNK_K": ck, "SPLIT": sp}, num_warps=w, num_stages=1)
        for bn, ck, w in DOWN_CONFIGS
        for sp in DOWN_SPLITS
    ]


def _pruner(reduction: str):  # noqa: ANN202
    """Triton's early pruning hook keeping chunks no wider than the kernel argument `reduction`
    (the length each program reduces over) rounded up to a power of two."""

    def prune(configs: list, named_args: dict, **kwargs) -> list:  # noqa: ANN001
        k = triton.next_power_of_2(int(kwargs[reduction]))
        kept = [c for c in configs if c.kwargs["CHUNK_K"] <= max(k, 32)]
        return kept or configs

    return prune


@triton.jit
def _gate_up_chunk(w_gate, w_up, k0, offs_k, n_mask, H: tl.constexpr):
    """The gate and up rows' columns k0 .. k0 + CHUNK_K ([BLOCK_N, CHUNK_K] each; zeros past H,
    so a chunk wholly past it moves no bytes)."""
    k = k0 + offs_k
    mask = n_mask[:, None] & (k < H)[None, :]
    return (
        tl.load(w_gate + k[None, :], mask=mask, other=0.0),
        tl.load(w_up + k[None, :], mask=mask, other=0.0),
    )


@autotune(configs=_configs(GATE_UP_CONFIGS), key=["H", "INTER", "TOP_K", "E"],
          prune=_pruner("H"))  # fmt: skip
@triton.jit
def _one_token_gate_up_kernel(
    x_ptr,
    w13_ptr,
    inter_ptr,
    logits_ptr,
    ids_ptr,
    weights_ptr,
    stride_we,
    stride_wn,
    route_scale,
    H: tl.constexpr,
    INTER: tl.constexpr,
    TOP_K: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK_K: tl.constexpr,
):
    """Grid (TOP_K, cdiv(INTER, BLOCK_N)). x [H] (one token), w13 [E, 2I, H] (unit last
    stride), inter [TOP_K, INTER] (contiguous), logits [E] (the token's router logits)."""
    s = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, CHUNK_K)
    pdl.wait(PDL)  # the experts depend on the router logits: nothing to load before
    e, weight = route_choice(logits_ptr, s, route_scale, E, E_PAD, TOP_K, RENORMALIZE, SCALE)
    if tl.program_id(1) == 0:
        tl.store(ids_ptr + s, e.to(ids_ptr.dtype.element_ty))
        tl.store(weights_ptr + s, weight.to(weights_ptr.dtype.element_ty))
    w_gate = w13_ptr + e.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    w_up = w_gate + INTER * stride_wn
    g_cur, u_cur = _gate_up_chunk(w_gate, w_up, 0, offs_k, n_mask, H)
    g_nxt, u_nxt = _gate_up_chunk(w_gate, w_up, CHUNK_K, offs_k, n_mask, H)
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, CHUNK_K):
        xk = tl.load(x_ptr + k0 + offs_k, mask=(k0 + offs_k) < H, other=0.0).to(tl.float32)
        acc_g += tl.sum(g_cur.to(tl.float32) * xk[None, :], axis=1)
        acc_u += tl.sum(u_cur.to(tl.float32) * xk[None, :], axis=1)
        # the chunk after next: issued before the next chunk's math (two in flight)
        g_cur = g_nxt
        u_cur = u_nxt
        g_nxt, u_nxt = _gate_up_chunk(w_gate, w_up, k0 + 2 * CHUNK_K, offs_k, n_mask, H)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(inter_ptr + s * INTER + offs_n, h.to(inter_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _route_all(
    logits_ptr,
    scale,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
):
    """Every choice of one token's routing at once: (ids [K_PAD] int32, float32 weights
    [K_PAD]), choice j at index j; the math and order of `route_choice` (the same bits)."""
    offs_e = tl.arange(0, E_PAD)
    offs_j = tl.arange(0, K_PAD)
    logits = tl.load(logits_ptr + offs_e, mask=offs_e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(offs_e < E, p, -1.0)
    best_p, best = tl.max(p, axis=0, return_indices=True)
    total = best_p
    ids = tl.where(offs_j == 0, best, 0)
    weights = tl.where(offs_j == 0, best_p, 0.0)
    p = tl.where(offs_e == best, -2.0, p)
    for j in tl.static_range(1, TOP_K):
        best_p, best = tl.max(p, axis=0, return_indices=True)
        total += best_p
        ids = tl.where(offs_j == j, best, ids)
        weights = tl.where(offs_j == j, best_p, weights)
        p = tl.where(offs_e == best, -2.0, p)
    if RENORMALIZE:
        weights = weights / total
    if SCALE:  # never with RENORMALIZE
        weights = weights * scale
    return ids, weights


@triton.jit
def _down_chunk(
    c,
    c_end,
    ids,
    offs_j,
    w2_ptr,
    stride_we,
    stride_wn,
    wsd_ptr,
    stride_sdn,
    offs_n,
    n_mask,
    offs_k,
    ROUTED_CHUNKS: tl.constexpr,
    PER_EXPERT: tl.constexpr,
    INTER: tl.constexpr,
    SHARED_INTER: tl.constexpr,
    CHUNK_K: tl.constexpr,
):
    """Chunk c of the token's weight sequence, [BLOCK_N, CHUNK_K]: routed expert c //
    PER_EXPERT's w2 columns, then (c >= ROUTED_CHUNKS) the shared expert's down columns; zeros
    from c_end on (no bytes moved)."""
    routed = c < ROUTED_CHUNKS
    j = tl.minimum(c // PER_EXPERT, offs_j.shape[0] - 1)
    e = tl.sum(tl.where(offs_j == j, ids, 0), axis=0).to(tl.int64)
    k_routed = (c % PER_EXPERT) * CHUNK_K + offs_k
    k_shared = (c - ROUTED_CHUNKS) * CHUNK_K + offs_k
    rows = offs_n[:, None].to(tl.int64)
    routed_ptr = w2_ptr + e * stride_we + rows * stride_wn + k_routed[None, :]
    shared_ptr = wsd_ptr + rows * stride_sdn + k_shared[None, :]
    k_ok = tl.where(routed, k_routed < INTER, k_shared < SHARED_INTER) & (c < c_end)
    ptr = tl.where(routed, routed_ptr, shared_ptr)
    return tl.load(ptr, mask=n_mask[:, None] & k_ok[None, :], other=0.0)


@autotune(configs=_down_configs(), key=["H", "INTER", "TOP_K", "E", "SHARED_INTER"],
          prune=_pruner("K_PRUNE"))  # fmt: skip
@triton.jit
def _one_token_down_kernel(
    inter_ptr,
    w2_ptr,
    logits_ptr,
    y_ptr,
    gate_ptr,
    wsd_ptr,
    out_ptr,
    weights_ptr,
    ws_ptr,
    cnt_ptr,
    stride_we,
    stride_wn,
    stride_sdn,
    route_scale,
    H: tl.constexpr,
    INTER: tl.constexpr,
    K_PRUNE: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    SHARED_INTER: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Grid (cdiv(H, BLOCK_N), SPLIT). inter [TOP_K, INTER] (gate_up's, contiguous), w2 [E, H,
    I] (unit last stride), y [2 SHARED_INTER] (the shared expert's gate | up outputs), gate [1]
    (its gate logit), w_sd [H, SHARED_INTER] (unit last stride), out [H] in inter's dtype.
    The token's weight sequence (its experts' w2 columns in choice order, then the shared
    expert's) is cut into SPLIT contiguous runs of chunks, one per program of a column tile:
    with SPLIT > 1 each writes its float32 partial to ws [SPLIT, H] and the last to arrive (an
    arrival counter per column tile, cnt) sums them in run order and resets its counter.
    weights: gate_up's stored routing weights, never read: each weight is rounded to their
    dtype before it scales its expert, as the tile path reads them back."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, CHUNK_K)
    offs_j = tl.arange(0, K_PAD)
    PER_EXPERT: tl.constexpr = (INTER + CHUNK_K - 1) // CHUNK_K
    ROUTED_CHUNKS: tl.constexpr = TOP_K * PER_EXPERT
    SHARED_CHUNKS: tl.constexpr = (SHARED_INTER + CHUNK_K - 1) // CHUNK_K if HAS_SHARED else 0
    NUM_CHUNKS: tl.constexpr = ROUTED_CHUNKS + SHARED_CHUNKS
    RUN: tl.constexpr = (NUM_CHUNKS + SPLIT - 1) // SPLIT  # chunks per program
    c_lo = tl.program_id(1) * RUN
    c_end = tl.minimum(c_lo + RUN, NUM_CHUNKS)
    # the routing reads the router logits, written before gate_up ran: safe before the wait
    ids, weights = _route_all(logits_ptr, route_scale, E, E_PAD, TOP_K, K_PAD, RENORMALIZE, SCALE)
    weights = weights.to(weights_ptr.dtype.element_ty).to(tl.float32)
    # the first two chunks (weights only) before the wait: they stream while gate_up finishes
    w_cur = _down_chunk(c_lo, c_end, ids, offs_j, w2_ptr, stride_we, stride_wn, wsd_ptr,
                        stride_sdn, offs_n, n_mask, offs_k, ROUTED_CHUNKS, PER_EXPERT, INTER,
                        SHARED_INTER, CHUNK_K)  # fmt: skip
    w_nxt = _down_chunk(c_lo + 1, c_end, ids, offs_j, w2_ptr, stride_we, stride_wn, wsd_ptr,
                        stride_sdn, offs_n, n_mask, offs_k, ROUTED_CHUNKS, PER_EXPERT, INTER,
                        SHARED_INTER, CHUNK_K)  # fmt: skip
    pdl.wait(PDL)
    shared_scale = tl.sum(tl.full((1,), 1.0, tl.float32), axis=0)  # a float32 scalar
    if HAS_GATE:
        shared_scale = tl.sigmoid(tl.load(gate_ptr).to(tl.float32))
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    c = c_lo
    while c < c_end:  # NOTE: a while loop: the interpreter takes no range over runtime bounds
        if c < ROUTED_CHUNKS:
            j = c // PER_EXPERT
            k = (c % PER_EXPERT) * CHUNK_K + offs_k
            a = tl.load(inter_ptr + j * INTER + k, mask=k < INTER, other=0.0).to(tl.float32)
            scale = tl.sum(tl.where(offs_j == j, weights, 0.0), axis=0)
        else:
            k = (c - ROUTED_CHUNKS) * CHUNK_K + offs_k
            g = tl.load(y_ptr + k, mask=k < SHARED_INTER, other=0.0).to(tl.float32)
            u = tl.load(y_ptr + SHARED_INTER + k, mask=k < SHARED_INTER, other=0.0)
            # rounded as silu_and_mul rounds it (silu(g) to the activation dtype first)
            act = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32)
            a = (act * u.to(tl.float32)).to(u.dtype).to(tl.float32)
            scale = shared_scale
        acc += tl.sum(w_cur.to(tl.float32) * a[None, :], axis=1) * scale
        # the chunk after next: issued before the next chunk's math (two in flight)
        w_cur = w_nxt
        w_nxt = _down_chunk(c + 2, c_end, ids, offs_j, w2_ptr, stride_we, stride_wn, wsd_ptr,
                            stride_sdn, offs_n, n_mask, offs_k, ROUTED_CHUNKS, PER_EXPERT,
                            INTER, SHARED_INTER, CHUNK_K)  # fmt: skip
        c += 1
    if SPLIT == 1:
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(ws_ptr + tl.program_id(1) * H + offs_n, acc, mask=n_mask)
        # NOTE: every thread's partials are stored before the (single-thread) release
        tl.debug_barrier()
        tile = tl.program_id(0)
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # the last run of this column tile: sum the runs in order
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for r in tl.static_range(SPLIT):
                total += tl.load(ws_ptr + r * H + offs_n, mask=n_mask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call


def one_token_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    renormalize: bool,
    scale: float | None,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    down_config: dict | None = None,
) -> torch.Tensor:
    """x [1, H] (unit last stride), w13 [E, 2I, H], w2 [E, H, I] (unit last strides), logits
    [1, E] contiguous -> the MoE output [1, H] in x's dtype: routed experts (softmax top-k,
    renormalised when asked, or times `scale`: DeepSeek-V2's greedy rule) plus the shared
    expert when given (gate_up [1, 2Is], down [H, Is], gate [1, 1] or None; unit last strides).
    topk_ids [1, k] int32 and topk_weights [1, k] (float32 when `scale` is given) are outputs:
    the routing, as the tile path stores it. `down_config` ({"BLOCK_N", "CHUNK_K", "SPLIT"} and
    num_warps / num_stages: tests) runs the down kernel with that configuration instead of the
    tuner's choice."""
    top_k = topk_ids.shape[1]
    num_experts, two_i, hidden = w13.shape
    inter_size = two_i // 2
    if x.shape[0] != 1 or logits.shape != (1, num_experts) or not logits.is_contiguous():
        raise ValueError(
            f"one_token_experts serves one token's contiguous [1, E={num_experts}] logits, got "
            f"x {tuple(x.shape)}, logits {tuple(logits.shape)}"
        )
    inter = torch.empty(top_k, inter_size, dtype=x.dtype, device=x.device)
    scaled = scale is not None
    common = dict(
        TOP_K=top_k, E=num_experts, E_PAD=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize and not scaled, SCALE=scaled,
    )  # fmt: skip
    route_scale = float(scale) if scaled else 1.0
    _one_token_gate_up_kernel[lambda m: (top_k, triton.cdiv(inter_size, m["BLOCK_N"]))](
        x, w13, inter, logits, topk_ids, topk_weights, w13.stride(0), w13.stride(1),
        route_scale, H=hidden, INTER=inter_size, **common,
        **pdl.launch_kwargs(x),
    )  # fmt: skip
    has_shared = shared_gate_up is not None and shared_down is not None
    y = shared_gate_up if has_shared else x  # dummies when there is no shared expert
    wsd = shared_down if has_shared else w2
    shared_inter = wsd.shape[1] if has_shared else 16
    gate = shared_gate if shared_gate is not None else x
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    down_meta = {}
    kernel = _one_token_down_kernel
    if down_config is not None:  # the jitted function under the tuner, with this configuration
        kernel, down_meta = _one_token_down_kernel.fn, dict(down_config)
        if not 1 <= down_meta.get("SPLIT", 1) <= SPLIT_MAX:
            raise ValueError(f"down SPLIT must be in 1..{SPLIT_MAX}: {down_config}")
    ws = torch.empty(SPLIT_MAX, hidden, dtype=torch.float32, device=x.device)
    # one counter per column tile of the smallest BLOCK_N the tuner may pick (2)
    counters = arrival_counters("moe-one-token-down", w2, triton.cdiv(hidden, 2))
    kernel[lambda m: (triton.cdiv(hidden, m["BLOCK_N"]), m["SPLIT"])](
        inter, w2, logits, y, gate, wsd, out, topk_weights, ws, counters, w2.stride(0),
        w2.stride(1), wsd.stride(0), route_scale, H=hidden, INTER=inter_size,
        K_PRUNE=max(inter_size, shared_inter if has_shared else 0),
        K_PAD=triton.next_power_of_2(top_k), HAS_SHARED=has_shared, SHARED_INTER=shared_inter,
        HAS_GATE=has_shared and shared_gate is not None, **common, **down_meta,
        **pdl.launch_kwargs(x),
    )  # fmt: skip
    return out
