"""The last kernel of the Triton `moe` backend: each token's k weighted pair outputs summed, the
block's gated shared expert added, one rounding to the activation dtype.

out[t] = sum_j pair_out[t * k + j] + sigmoid(shared_gate[t]) * shared_out[t], all in float32,
the k terms in choice order (a fixed order, no atomics: the result does not depend on
scheduling). The shared term is optional (deltaserve.ops.moe's contract); fusing it here saves
the three elementwise launches (sigmoid, product, sum) a MoE block's combine would take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops.moe.triton_gemm import interpreting


@triton.jit
def _reduce_kernel(
    pair_out_ptr,
    shared_ptr,
    gate_ptr,
    out_ptr,
    num_tokens,
    stride_shared,
    stride_gate,
    H: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_mask = offs_t < num_tokens
    mask = t_mask[:, None] & (offs_h < H)[None, :]
    rows = offs_t[:, None].to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(
            pair_out_ptr + (rows * TOP_K + j) * H + offs_h[None, :], mask=mask, other=0.0
        )
    if HAS_SHARED:
        shared = tl.load(
            shared_ptr + rows * stride_shared + offs_h[None, :], mask=mask, other=0.0
        ).to(tl.float32)
        if HAS_GATE:
            g = tl.load(gate_ptr + offs_t.to(tl.int64) * stride_gate, mask=t_mask, other=0.0)
            g = tl.sigmoid(g.to(tl.float32))
            shared = shared * g[:, None]
        acc += shared
    tl.store(out_ptr + rows * H + offs_h[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_pairs(
    pair_out: torch.Tensor,
    top_k: int,
    dtype: torch.dtype,
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """pair outputs [T * k, H] float32 (contiguous) -> [T, H] in `dtype`: each token's k
    outputs summed in float32, in choice order, plus sigmoid(shared_gate) * shared_out when
    given (shared_out [T, H] with a unit last stride, shared_gate [T, 1] any strides; checked
    by the caller, deltaserve.ops.moe.check_shared)."""
    num_pairs, hidden = pair_out.shape
    num_tokens = num_pairs // top_k
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=pair_out.device)
    if num_tokens == 0:
        return out
    block_t = 16 if interpreting() else 4
    block_h = min(1024, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_h))
    has_shared, has_gate = shared_out is not None, shared_gate is not None
    _reduce_kernel[grid](
        pair_out,
        shared_out if has_shared else pair_out,  # a dummy pointer when absent (never read)
        shared_gate if has_gate else pair_out,
        out,
        num_tokens,
        shared_out.stride(0) if has_shared else 0,
        shared_gate.stride(0) if has_gate else 0,
        H=hidden,
        TOP_K=top_k,
        HAS_SHARED=has_shared,
        HAS_GATE=has_gate,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
    )
    return out
