"""The split-latent MLA decode's last two steps in one launch for a step of a few rows: the
splits' partial outputs merged by their log-sum-exps (what merge_splits_kernel does) and the
merged latent output multiplied by W_UV per head (what the layer's head_matmul does next).

Why: at batch 1 the decode ends in two short kernels, the merge (16 programs reading 32 splits x
512 float32 each, 2.9 us on an H100 without PDL) and the W_UV product (3.3 us), each a boundary
in the step's chain; the step preparation's rope / norm joined to the W_UK product in one launch
measured +4.3% at V2-Lite batch 1 (docs/benchmarks.md). Here a program per (head, BLOCK_N
columns of V) loads its W_UV tile [R, BLOCK_N] before the PDL wait (weights only), then merges
its head's splits for each of the step's rows and multiplies (CUDA-core FMAs, float32): each
program of a head repeats the merge (V / BLOCK_N times), which is why it serves only a few rows
(MAX_ROWS). The merged output is rounded to the activation dtype before the product, as the two
launches round it. On by default (DELTASERVE_MLA_MERGE=fused): DeepSeek-V2-Lite decode batch 1
451.3 tok/s against 437.1 and 429.7 with the two launches (one H200, one call; docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.moe.triton_gemm import interpreting

MAX_ROWS = 4  # the most token rows one launch serves (each program merges every row)
SPLIT_STEP = 8  # splits merged at a time (bounds the partials held in registers)


def _configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=1)
        for bn, w in ((16, 4), (32, 4), (32, 8), (64, 8))
    ]


@autotune(configs=_configs(), key=["R", "V", "NUM_SPLITS"])
@triton.jit
def _merge_w_uv_kernel(
    part_out_ptr,  # [rows, H, NUM_SPLITS, R_PAD] float32
    part_lse_ptr,  # [rows, H, NUM_SPLITS] float32, base-2 log-sum-exps
    w_ptr,  # [H, R, V]
    out_ptr,  # [rows, H, V]
    rows,
    H,
    stride_wh,
    stride_wk,
    stride_ot,
    stride_oh,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    V: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    STEP: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (H, cdiv(V, BLOCK_N)): out[t, h, n block] = merge_t,h @ W_UV[h][:, n block] for
    every row t < rows."""
    h = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < V
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < R
    w = tl.load(
        w_ptr + h * stride_wh + offs_r[:, None] * stride_wk + offs_n[None, :],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )  # [R_PAD, BLOCK_N]: weights only, so before the wait (ops/pdl.py)
    pdl.wait(PDL)
    dtype = out_ptr.dtype.element_ty
    t = 0
    while t < rows:  # NOTE: a while loop: the interpreter takes no range over runtime bounds
        row = t * H + h  # int64 (h is)
        offs_s = tl.arange(0, S_PAD)
        lse = tl.load(
            part_lse_ptr + row * NUM_SPLITS + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf")
        )
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len 0): zeros
        total = tl.sum(tl.exp2(lse - m), axis=0)
        o = tl.zeros((R_PAD,), dtype=tl.float32)
        for s0 in tl.static_range(0, S_PAD, STEP):
            s = s0 + tl.arange(0, STEP)
            s_mask = s < NUM_SPLITS
            ls = tl.load(part_lse_ptr + row * NUM_SPLITS + s, mask=s_mask, other=float("-inf"))
            ws = tl.exp2(ls - m)  # [STEP]; 0 for empty splits
            parts = tl.load(
                part_out_ptr + (row * NUM_SPLITS + s)[:, None] * R_PAD + offs_r[None, :],
                mask=s_mask[:, None] & (ws[:, None] > 0.0),
                other=0.0,
            )  # [STEP, R_PAD]
            o += tl.sum(parts * ws[:, None], axis=0)
        o = o / tl.where(total > 0.0, total, 1.0)
        o = o.to(dtype).to(tl.float32)  # rounded as the merge kernel stores it
        acc = tl.sum(w.to(tl.float32) * o[:, None], axis=0)  # [BLOCK_N]
        out = out_ptr + t * stride_ot + h * stride_oh + offs_n
        tl.store(out, acc.to(dtype), mask=n_mask)
        t += 1


def merge_w_uv(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    w_uv: torch.Tensor,
    out: torch.Tensor,
    r: int,
) -> torch.Tensor:
    """part_out [rows, H, S, R_PAD] / part_lse [rows, H, S] float32 (the split decode's, rows <=
    MAX_ROWS), w_uv [H, R, V] (unit last stride), out [T >= rows, H, V] (unit last stride):
    writes out[:rows] = merge @ W_UV per head and returns out (rows past `rows` untouched)."""
    rows, num_heads, splits, r_pad = part_out.shape
    if rows > MAX_ROWS:
        raise ValueError(f"merge_w_uv serves at most {MAX_ROWS} rows, got {rows}")
    if w_uv.shape[:2] != (num_heads, r) or w_uv.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(
            f"merge_w_uv: W_UV {tuple(w_uv.shape)} does not fit {num_heads} heads x R {r}"
        )
    v = w_uv.shape[2]
    if rows:
        _merge_w_uv_kernel[lambda m: (num_heads, triton.cdiv(v, m["BLOCK_N"]))](
            part_out, part_lse, w_uv, out, rows, num_heads, w_uv.stride(0), w_uv.stride(1),
            out.stride(0), out.stride(1), R=r, R_PAD=r_pad, V=v, NUM_SPLITS=splits,
            S_PAD=max(SPLIT_STEP, triton.next_power_of_2(splits)), STEP=SPLIT_STEP,
            **pdl.launch_kwargs(out),
        )  # fmt: skip
    return out
