"""The torch reference of the `moe` op family (see deltaserve.ops.moe for the contract).

Tokens are grouped by expert (one stable sort of the flattened top-k ids); each expert that
received tokens runs its gate/up matmul, silu(gate) * up and its down matmul in the activation
dtype, as HF's experts do, and its outputs, scaled by their routing weights, are accumulated in
float32, the gated shared expert (when given) added in float32, and the sum rounded once to
the activation dtype. Finding the experts that received tokens reads the per-expert counts on
the host (the one sync; on a GPU this backend cannot run inside a CUDA graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops.moe import add_shared, resolve_shared, route, router_logits_torch


def fused_experts(
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
    num_experts = w13.shape[0]
    inter = w13.shape[1] // 2
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the host sync
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].float()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tokens = token_of[start : start + n]
        h = F.linear(x[tokens], w13[e])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, w2[e]).float() * weight_of[start : start + n, None]
        out.index_add_(0, tokens, y)
        start += n
    return add_shared(out, shared_out, shared_gate).to(x.dtype)


class TorchMoE:
    """The reference `moe` backend: routes (when given router logits) and runs the experts."""

    name = "torch"
    supports_cuda_graph = False  # the per-expert token counts are read on the host

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
        shared_out = resolve_shared(x, shared_out, shared_gate, shared_gate_up, shared_down)
        if topk_ids is None or topk_weights is None:
            if router_logits is None or top_k <= 0:
                raise ValueError("moe: give router_logits and top_k, or topk_ids and topk_weights")
            topk_ids, topk_weights = route(
                router_logits, top_k, renormalize, x.dtype, routed_scaling_factor
            )
        return fused_experts(x, w13, w2, topk_ids, topk_weights, shared_out, shared_gate)
