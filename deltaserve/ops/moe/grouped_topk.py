"""DeepSeek-V2 routing: softmax scores, greedy or group-limited top-k, scaled, on the device.

`deepseek_route(router_logits, top_k, method, ...)` returns the routing a `moe` backend takes
as `topk_ids` / `topk_weights` (HF's modeling_deepseek_v2 `DeepseekV2TopkRouter`):

    scores = softmax(router_logits) in float32                                   [T, E]
    greedy:                the k largest scores
    group_limited_greedy:  experts in n_group consecutive groups; a group's score is its best
                           expert's; keep the topk_group best groups, zero the other groups'
                           scores, then the k largest
    weights = top-k scores * routed_scaling_factor

No renormalisation (DeepSeek-V2 configs set norm_topk_prob false; HF ignores it). With
`renormalize` the weights are divided by their sum instead of scaled, as DeepSeek's own V2 code
does for norm_topk_prob. Torch ops only: no host sync (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

ROUTING_METHODS = ("greedy", "group_limited_greedy")


def deepseek_route(
    router_logits: torch.Tensor,
    top_k: int,
    method: str = "greedy",
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = False,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] in `dtype`, float32
    when None). See the module docstring for the rule."""
    scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    if method == "group_limited_greedy":
        T, E = scores.shape
        if not n_group or not topk_group or E % n_group:
            raise ValueError(
                f"group_limited_greedy needs n_group dividing {E} experts and topk_group "
                f"(got n_group={n_group}, topk_group={topk_group})"
            )
        grouped = scores.view(T, n_group, E // n_group)  # [T, G, E / G]
        group_scores = grouped.max(dim=-1).values  # [T, G]
        keep = torch.topk(group_scores, topk_group, dim=-1).indices  # [T, topk_group]
        mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)  # [T, G]
        scores = (grouped * mask[:, :, None]).view(T, E)  # other groups' scores zeroed
    elif method != "greedy":
        raise ValueError(f"topk_method {method!r} is not supported; use one of {ROUTING_METHODS}")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * routed_scaling_factor
    return ids, weights.to(dtype or torch.float32)
