"""The sparse mixture-of-experts feed-forward block (Qwen3.5-MoE): a router, routed experts
stacked over experts, and a gated shared expert.

`output = experts(x; top-k of softmax(gate(x))) + sigmoid(shared_expert_gate(x)) *
shared_expert(x)`. The routed experts run through the `moe` backend chosen at start-up
(`ctx.kernels.moe`, see deltaserve.ops.moe).

Checkpoint layouts (both load, see deltaserve.models.qwen3_5_moe): released fused experts
`experts.gate_up_proj [E, 2I, H]` (gate rows first) and `experts.down_proj [E, H, I]`, or
per-expert `experts.{e}.gate_proj / up_proj / down_proj.weight` (what HF save_pretrained writes).
Under tensor parallelism every rank holds every expert (the routed output is computed whole on
each rank; the shared expert is split like a dense MLP).
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.forward_context import ForwardContext
from deltaserve.layers.mlp import GatedMLP
from deltaserve.layers.weight_loading import Slot
from deltaserve.ops.moe import MoESpec


class MoEExperts(nn.Module):
    """The routed experts' weights: `w13` [E, 2I, H] (shards gate_proj, up_proj) and `w2`
    [E, H, I], each expert's tensors filling one slice of the stacked parameters."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.stacked_experts = num_experts
        self.shard_offsets = {
            "gate_proj": (0, intermediate),
            "up_proj": (intermediate, intermediate),
        }
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def weight_slots(self, attr: str) -> list[Slot]:
        shards = list(self.shard_offsets) if attr == "w13" else [None]
        return [(shard, e) for e in range(self.stacked_experts) for shard in shards]


class SparseMoeBlock(nn.Module):
    """Router `gate` [E, H], experts, `shared_expert` (a GatedMLP) and `shared_expert_gate`
    [1, H]; called as `ffn(h, ctx)`."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        shared_intermediate: int,
        norm_topk_prob: bool = True,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.op_spec = MoESpec(num_experts, top_k, hidden, intermediate)
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = MoEExperts(num_experts, hidden, intermediate)
        self.shared_expert = GatedMLP(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        moe = ctx.kernels.moe
        if moe is None:
            raise RuntimeError("a MoE layer ran without a moe backend (Kernels.moe is None)")
        routed = moe(
            x,
            self.experts.w13,
            self.experts.w2,
            router_logits=self.gate(x),
            top_k=self.top_k,
            renormalize=self.norm_topk_prob,
        )
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ctx)
        return routed + shared
