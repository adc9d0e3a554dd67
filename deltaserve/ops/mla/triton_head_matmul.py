"""Per-head matmul of a decode step's few rows: out[t, h] = x[t, h] @ W[h] for the MLA layer's
absorbed projections (q_lat = q_nope W_UK, o = out W_UV), in one launch.

Why: the layer's `torch.bmm` over [H, T, K] x [H, K, N] ran cuBLAS at 3.3 us a call on an H200
for DeepSeek-V2-Lite's 2 MB per matrix at batch 1 (two calls per layer, 0.18 ms of a 2.7 ms
step: docs/results/profile-dsv2-lite-b1-no-pdl-h200.txt), plus a copy to bring the result back
to [T, H, N]. Here one program per (head, BLOCK_N output columns) loads its W tile [K, BLOCK_N]
before the wait on the previous kernel (ops/pdl.py: weights only), then x's rows of that head
(any strides: q_nope is a column slice of q) padded to 16-64 rows for one tensor-core dot, and
writes [T, H, N] directly. Block sizes autotuned per (K, N, rows padded); float32 operands run
the dot in IEEE float32 (the parity models), untuned, over K in steps of 64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.autotune import autotune
from deltaserve.ops.mla import bmm_per_head
from deltaserve.ops.moe.triton_gemm import dot_precision, interpreting

MAX_ROWS = 64  # the most rows (tokens) one launch serves: x padded to 16, 32 or 64


def _configs() -> list[triton.Config]:
    if interpreting():
        return [triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=1)
        for bn, w in ((16, 2), (32, 4), (64, 4), (64, 8), (128, 8))
    ]


def _prune_tiles(configs: list, named_args: dict, **kwargs) -> list:  # noqa: ANN001
    """Triton's early pruning hook: at most 256 elements of the x and W tiles per thread (the
    ones above spilled registers on sm_90 at K 512: tests/ops/test_mla_sm90_compile.py)."""
    k_pad, t_pad = kwargs["K_PAD"], kwargs.get("T_PAD", 16)

    def per_thread(c) -> float:  # noqa: ANN001
        return (t_pad + c.kwargs["BLOCK_N"]) * k_pad / (32 * c.num_warps)

    kept = [c for c in configs if per_thread(c) <= 256]
    return kept or [min(configs, key=per_thread)]


class TritonHeadMatmul:
    """`MLABackend.head_matmul` through `head_matmul` for steps of at most MAX_ROWS rows (decode
    and short chunks), torch.bmm above (prefill): a mixin for the CUDA MLA backends."""

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= MAX_ROWS:
            return head_matmul(x, w)
        return bmm_per_head(x, w)


@autotune(configs=_configs(), key=["K", "N", "T_PAD"], prune=_prune_tiles)
@triton.jit
def _head_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    T,
    stride_xt,
    stride_xh,
    stride_wh,
    stride_wk,
    stride_ot,
    stride_oh,
    K: tl.constexpr,
    N: tl.constexpr,
    K_PAD: tl.constexpr,
    T_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (H, cdiv(N, BLOCK_N)). x [T, H, K] (unit last stride), W [H, K, N] (unit last
    stride), out [T, H, N] (unit last stride). K in steps of BLOCK_K (a power of two dividing
    K_PAD: all of it in 16 bits, where W's whole tile is read before the wait)."""
    h = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_t = tl.arange(0, T_PAD)
    t_mask = offs_t < T
    w_base = w_ptr + h * stride_wh + offs_n[None, :]
    x_base = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + h * stride_xh
    offs_k = tl.arange(0, BLOCK_K)
    # W's first K step: weights only, so before the wait (ops/pdl.py)
    w0_mask = (offs_k < K)[:, None] & n_mask[None, :]
    w0 = tl.load(w_base + offs_k[:, None] * stride_wk, mask=w0_mask, other=0.0)
    pdl.wait(PDL)  # x is the previous kernels' output
    acc = tl.zeros((T_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in tl.static_range(0, K_PAD, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        if k0 == 0:
            w = w0
        else:
            w_mask = k_mask[:, None] & n_mask[None, :]
            w = tl.load(w_base + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        x = tl.load(x_base + k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)  # [T_PAD, BLOCK_N] float32
    out = out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & n_mask[None, :])


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] (unit last stride, T <= MAX_ROWS) @ w [H, K, N] (unit last stride) ->
    [T, H, N] contiguous, in x's dtype, accumulated in float32."""
    T, H, K = x.shape
    if w.dim() != 3 or w.shape[0] != H or w.shape[1] != K:
        raise ValueError(f"head_matmul: x {tuple(x.shape)} does not match w {tuple(w.shape)}")
    if T > MAX_ROWS:
        raise ValueError(f"head_matmul serves at most {MAX_ROWS} rows, got {T}")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("head_matmul needs a unit last stride on x and w")
    N = w.shape[2]
    k_pad = max(16, triton.next_power_of_2(K))
    # float32 (the parity models): K in steps of 64, as one step at K 512 and 64 rows asked
    # for 256 KB of shared memory on an H200 (the limit is 227 KB)
    block_k = min(k_pad, 64) if x.dtype == torch.float32 else k_pad
    out = torch.empty(T, H, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    _head_matmul_kernel[lambda meta: (H, triton.cdiv(N, meta["BLOCK_N"]))](
        x, w, out, T, x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0),
        out.stride(1), K=K, N=N, K_PAD=k_pad, T_PAD=max(16, triton.next_power_of_2(T)),
        PRECISION=dot_precision(x.dtype), BLOCK_K=block_k, **pdl.launch_kwargs(x),
    )  # fmt: skip
    return out
