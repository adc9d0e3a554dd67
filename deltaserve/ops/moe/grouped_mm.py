"""The `grouped_mm` `moe` backend: the expert GEMMs as two `torch._grouped_mm` calls (PyTorch's
CUTLASS grouped GEMM; bf16 on compute capability 9.x / 10.x, see
backend_checks.check_grouped_mm_moe).

Per call: routing on the device (the Triton routing kernel on CUDA, `route` elsewhere: the same
math), the T * k pairs sorted by expert (a stable argsort; no padding: `offs` [E] int32 holds
each expert's end row, empty experts repeat the previous end), the gathered rows
x[pair // k] [S, H] through `_grouped_mm` with w13 viewed [E, H, 2I], silu(gate) * up in x's
dtype (as the reference), `_grouped_mm` with w2 viewed [E, I, H], the rows scaled by their
routing weights in float32, put back in pair order and summed over k (the gated shared
expert, when given, added in float32). Every step is a device
op whose sizes follow from the shapes (no host sync on the fast path: CUDA-graph safe; the op's
own fallback for other devices reads `offs` on the host, which the capability check excludes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops.moe import (
    add_shared,
    check_inputs,
    resolve_shared,
    route,
    router_logits_torch,
)


def grouped_mm_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    shared_out: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids / topk_weights [T, k] (optionally
    shared_out [T, H], shared_gate [T, 1]: see deltaserve.ops.moe) -> [T, H]."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1).long()  # [S]
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert
    a = x[order // top_k]  # [S, H] rows by expert
    h = torch._grouped_mm(a, w13.transpose(1, 2), offs=offs)  # [S, 2I]
    h = F.silu(h[:, :inter]) * h[:, inter:]  # [S, I]
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)  # [S, H]
    y = y.float() * topk_weights.reshape(-1)[order].float()[:, None]
    pair_out = torch.empty_like(y).index_copy_(0, order, y)  # [S, H] back in pair order
    routed = pair_out.view(num_tokens, top_k, hidden).sum(dim=1)  # [T, H] float32
    return add_shared(routed, shared_out, shared_gate).to(x.dtype)


class GroupedMmMoE:
    """The `moe` backend object over `torch._grouped_mm`."""

    name = "grouped_mm"
    supports_cuda_graph = True  # device ops only; offsets stay on the device

    router_logits = staticmethod(router_logits_torch)  # F.linear(x.float(), weight)

    def __call__(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        router_logits: torch.Tensor | None = None,
        top_k: int = 0,
        renormalize: bool = True,
        routed_scaling_factor: float | None = None,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        shared_out: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
        shared_gate_up: torch.Tensor | None = None,
        shared_down: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_inputs(x, w13, w2, router_logits, top_k, topk_ids, topk_weights)
        shared_out = resolve_shared(x, shared_out, shared_gate, shared_gate_up, shared_down)
        if topk_ids is None or topk_weights is None:
            if x.is_cuda:
                from deltaserve.ops.moe.triton_routing import route_triton

                topk_ids, topk_weights = route_triton(
                    router_logits, top_k, renormalize, x.dtype, routed_scaling_factor
                )
            else:
                topk_ids, topk_weights = route(
                    router_logits, top_k, renormalize, x.dtype, routed_scaling_factor
                )
        if topk_ids.shape[0] == 0:
            return torch.zeros_like(x)
        return grouped_mm_experts(x, w13, w2, topk_ids, topk_weights, shared_out, shared_gate)
