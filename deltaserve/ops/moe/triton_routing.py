"""Routing on the device in one Triton kernel: router logits [T, E] -> (topk_ids [T, k] int32,
topk_weights [T, k] in the activation dtype).

One program per token: the logits row is read once, softmax in float32 over all experts, the k
largest taken one at a time (argmax, then masked out; ties go to the lower expert id),
renormalised to sum to 1 when asked, cast to the activation dtype. The same math as
`deltaserve.ops.moe.route` without its five launches, and no host sync (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    stride_t,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + t * stride_t + offs_e, mask=offs_e < E, other=float("-inf"))
    logits = logits.to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)  # padded experts: exp(-inf) = 0
    p = tl.where(offs_e < E, p, -1.0)
    offs_k = tl.arange(0, K_PAD)
    top_w = tl.zeros((K_PAD,), dtype=tl.float32)
    top_i = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, axis=0)
        best_p = tl.max(p, axis=0)
        top_w = tl.where(offs_k == j, best_p, top_w)
        top_i = tl.where(offs_k == j, best.to(tl.int32), top_i)
        p = tl.where(offs_e == best, -2.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    k_mask = offs_k < TOP_K
    tl.store(ids_ptr + t * TOP_K + offs_k, top_i, mask=k_mask)
    tl.store(
        weights_ptr + t * TOP_K + offs_k,
        top_w.to(weights_ptr.dtype.element_ty),
        mask=k_mask,
    )


def route_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] (unit last stride) -> (topk_ids [T, k] int32, topk_weights [T, k]
    in `dtype`), as `deltaserve.ops.moe.route` computes them."""
    if router_logits.dim() != 2 or router_logits.stride(-1) != 1:
        raise ValueError(
            f"router logits must be [T, E] with a unit last stride, got {tuple(router_logits.shape)}"
        )
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts} (the number of experts)")
    dev = router_logits.device
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(num_tokens, top_k, dtype=dtype, device=dev)
    if num_tokens == 0:
        return ids, weights
    _route_kernel[(num_tokens,)](
        router_logits,
        ids,
        weights,
        router_logits.stride(0),
        E=num_experts,
        E_PAD=triton.next_power_of_2(num_experts),
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
    )
    return ids, weights
