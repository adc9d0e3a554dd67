"""Routing on the device in one Triton kernel: router logits [T, E] -> (topk_ids [T, k] int32,
topk_weights [T, k] in the activation dtype, or float32 by DeepSeek-V2's rule).

BLOCK_T tokens per program: each logits row is read once, softmax in float32 over all experts, the k
largest taken one at a time (argmax, then masked out; ties go to the lower expert id); then
Qwen's rule: renormalised to sum to 1 when asked, cast to the activation dtype; or DeepSeek-V2's
greedy rule (SCALE): times routed_scaling_factor, stored in float32. The same math as
`deltaserve.ops.moe.route` without its five launches, and no host sync (CUDA-graph safe).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl


@triton.jit
def _route_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    num_tokens,
    stride_t,
    scale,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    rows = offs_t[:, None].to(tl.int64)
    offs_e = tl.arange(0, E_PAD)[None, :]
    valid = t_mask[:, None] & (offs_e < E)
    logits = tl.load(logits_ptr + rows * stride_t + offs_e, mask=valid, other=float("-inf"))
    logits = tl.where(t_mask[:, None], logits.to(tl.float32), 0.0)  # no NaN in padded rows
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]  # padded experts: exp(-inf) = 0
    p = tl.where(offs_e < E, p, -1.0)
    offs_k = tl.arange(0, K_PAD)[None, :]
    top_w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best_p, best = tl.max(p, axis=1, return_indices=True)  # one reduction, ties to lower
        best_p = best_p[:, None]  # [BLOCK_T, 1]
        best = best[:, None]
        top_w = tl.where(offs_k == j, best_p, top_w)
        top_i = tl.where(offs_k == j, best.to(tl.int32), top_i)
        p = tl.where(offs_e == best, -2.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    if SCALE:  # DeepSeek-V2 greedy (never with RENORMALIZE): float32 times the factor
        top_w = top_w * scale
    out_mask = t_mask[:, None] & (offs_k < TOP_K)
    out = rows * TOP_K + offs_k
    tl.store(ids_ptr + out, top_i, mask=out_mask)
    tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=out_mask)


def route_triton(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    dtype: torch.dtype,
    routed_scaling_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] -> (topk_ids [T, k] int32, topk_weights [T, k] in `dtype`; with
    `routed_scaling_factor` float32, times the factor, not renormalised), as
    `deltaserve.ops.moe.route` computes them. Rows may be strided (a slice of a fused
    projection's output is read in place); a non-unit last stride is copied first."""
    if router_logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got {tuple(router_logits.shape)}")
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts} (the number of experts)")
    dev = router_logits.device
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=dev)
    scaled = routed_scaling_factor is not None
    weights_dtype = torch.float32 if scaled else dtype
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=dev)
    if num_tokens == 0:
        return ids, weights
    # the interpreter's cost is per program: many tokens per program there
    block_t = 16 if os.environ.get("TRITON_INTERPRET", "0") == "1" else 4
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits,
        ids,
        weights,
        num_tokens,
        router_logits.stride(0),
        float(routed_scaling_factor) if scaled else 1.0,
        E=num_experts,
        E_PAD=triton.next_power_of_2(num_experts),
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize and not scaled,
        SCALE=scaled,
        BLOCK_T=block_t,
        **pdl.launch_kwargs(router_logits),
    )
    return ids, weights
