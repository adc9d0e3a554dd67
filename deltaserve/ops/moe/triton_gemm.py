"""Grouped expert GEMMs over pairs sorted and aligned by expert (triton_align), and the tile
math the decode kernels (triton_decode) share.

Pairs s = t * k + j (token t's j-th choice). Two kernels, each program one (block of block_m
aligned rows, BLOCK_N output columns) tile of one expert:
- gate_up: inter[s] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T), both halves accumulated
  in float32 in one pass over H (SiLU-and-mul fused; the [S, 2I] product is never written);
- down: pair_out[s] = topk_weight[s] * (inter[s] @ w2[e].T), float32.
`triton_reduce.reduce_pairs` then sums the k pair outputs of each token into [T, H] in x's
dtype, with the gated shared expert when given.

Block sizes: block_m is chosen from the pairs per expert before the alignment (it sets the
padding); BLOCK_N / BLOCK_K / warps / stages are autotuned on the GPU per (block_m, H, I) on
the first call (eager, before any CUDA-graph capture; block_m stands for the size class, so a
server tunes at most four times per shape); the interpreter runs one small configuration.
float32 inputs use IEEE dots (no TF32 rounding).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deltaserve.ops.autotune import autotune
from deltaserve.ops.moe.triton_align import AlignedPairs


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def gate_up_partial(
    x_ptr,
    stride_x,
    token,
    row_mask,
    w_ptr,
    stride_wn,
    offs_n,
    n_mask,
    k_lo,
    H: tl.constexpr,
    INTER: tl.constexpr,
    K_SPLIT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The gate and up accumulators [rows, BLOCK_N] float32 over K = k_lo .. k_lo + K_SPLIT
    (clipped to H) of one expert's w13 [2I, H] (`w_ptr`)."""
    acc_g = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    a_rows = x_ptr + token[:, None] * stride_x
    g_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    u_rows = w_ptr + (offs_n[:, None] + INTER).to(tl.int64) * stride_wn
    for kk in range(0, K_SPLIT, BLOCK_K):
        k = k_lo + kk + tl.arange(0, BLOCK_K)
        k_mask = k < H
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        wg = tl.load(g_rows + k[None, :], mask=w_mask, other=0.0)
        wu = tl.load(u_rows + k[None, :], mask=w_mask, other=0.0)
        acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=PRECISION)
    return acc_g, acc_u


@triton.jit
def gate_up_tile(
    x_ptr,
    stride_x,
    token,
    row_mask,
    w_ptr,
    stride_wn,
    offs_n,
    n_mask,
    H: tl.constexpr,
    INTER: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """silu(x[token] @ w[n].T) * (x[token] @ w[I + n].T) -> [rows, BLOCK_N] float32, where
    `w_ptr` points at one expert's w13 [2I, H] and `token` [rows] int64 selects rows of x."""
    acc_g, acc_u = gate_up_partial(
        x_ptr, stride_x, token, row_mask, w_ptr, stride_wn, offs_n, n_mask, 0,
        H, INTER, H, ROWS, BLOCK_N, BLOCK_K, PRECISION,
    )  # fmt: skip
    return acc_g * tl.sigmoid(acc_g) * acc_u


@triton.jit
def down_tile(
    inter_ptr,
    stride_i,
    pair,
    row_mask,
    w_ptr,
    stride_wn,
    offs_n,
    n_mask,
    INTER: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """inter[pair] @ w[n].T -> [rows, BLOCK_N] float32, where `w_ptr` points at one expert's
    w2 [H, I] and `pair` [rows] int64 selects rows of inter [S, I]."""
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    a_rows = inter_ptr + pair[:, None] * stride_i
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, INTER, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < INTER
        a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


def _sorted_configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in (
            (64, 64, 4, 3),
            (64, 64, 4, 4),
            (64, 128, 4, 3),
            (128, 64, 4, 3),
            (128, 64, 8, 4),
            (128, 128, 8, 3),
            (32, 128, 4, 4),
            (256, 64, 8, 3),
        )
    ]


@autotune(configs=_sorted_configs(), key=["BLOCK_M", "H", "INTER"])
@triton.jit
def _sorted_gate_up_kernel(
    x_ptr,
    w13_ptr,
    inter_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_rows_ptr,
    num_pairs,
    stride_x,
    stride_we,
    stride_wn,
    stride_i,
    TOP_K: tl.constexpr,
    H: tl.constexpr,
    INTER: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    h = gate_up_tile(
        x_ptr, stride_x, pair // TOP_K, valid, w13_ptr + e * stride_we, stride_wn,
        offs_n, n_mask, H, INTER, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
    )  # fmt: skip
    out = inter_ptr + pair[:, None] * stride_i + offs_n[None, :]
    tl.store(out, h.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@autotune(configs=_sorted_configs(), key=["BLOCK_M", "H", "INTER"])
@triton.jit
def _sorted_down_kernel(
    inter_ptr,
    w2_ptr,
    weights_ptr,
    pair_out_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_rows_ptr,
    num_pairs,
    stride_i,
    stride_we,
    stride_wn,
    H: tl.constexpr,
    INTER: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    acc = down_tile(
        inter_ptr, stride_i, pair, valid, w2_ptr + e * stride_we, stride_wn,
        offs_n, n_mask, INTER, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
    )  # fmt: skip
    w = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    out = pair_out_ptr + pair[:, None] * H + offs_n[None, :]
    tl.store(out, acc * w[:, None], mask=valid[:, None] & n_mask[None, :])


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per aligned block from the mean pairs per expert (shapes only, no routing read)."""
    per_expert = num_pairs / num_experts
    if interpreting():
        return 32  # fewer, larger programs: the interpreter's cost is per program
    if per_expert <= 16:
        return 16
    if per_expert <= 48:
        return 32
    return 64 if per_expert <= 192 else 128


def sorted_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    aligned: AlignedPairs,
) -> torch.Tensor:
    """The gate_up and down GEMMs over aligned pairs -> pair outputs [S, H] float32 (weighted)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    num_experts, two_i, hidden = w13.shape
    inter_size = two_i // 2
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    nb = aligned.block_expert.numel()
    common = dict(PRECISION=dot_precision(x.dtype), BLOCK_M=aligned.block_m)
    _sorted_gate_up_kernel[lambda m: (nb, triton.cdiv(inter_size, m["BLOCK_N"]))](
        x, w13, inter, aligned.sorted_ids, aligned.block_expert, aligned.num_rows, num_pairs,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        TOP_K=top_k, H=hidden, INTER=inter_size, **common,
    )  # fmt: skip
    _sorted_down_kernel[lambda m: (nb, triton.cdiv(hidden, m["BLOCK_N"]))](
        inter, w2, topk_weights, pair_out, aligned.sorted_ids, aligned.block_expert,
        aligned.num_rows, num_pairs, inter.stride(0), w2.stride(0), w2.stride(1),
        H=hidden, INTER=inter_size, **common,
    )  # fmt: skip
    return pair_out
