"""The sparse mixture-of-experts feed-forward block (Qwen3.5-MoE): a router, routed experts
stacked over experts, and a gated shared expert.

`output = experts(x; top-k of softmax(gate(x))) + sigmoid(shared_expert_gate(x)) *
shared_expert(x)`. The routed experts run through the `moe` backend chosen at start-up
(`ctx.kernels.moe`, see deltaserve.ops.moe).

Checkpoint layouts (both load, see deltaserve.models.qwen3_5_moe): released fused experts
`experts.gate_up_proj [E, 2I, H]` (gate rows first) and `experts.down_proj [E, H, I]`, or
per-expert `experts.{e}.gate_proj / up_proj / down_proj.weight` (what HF save_pretrained writes).

Tensor parallelism: every rank holds every expert, but only its slice of each expert's
intermediate dimension (w13: its rows of the gate projection and its rows of the up projection;
w2: the same columns), so its routed output is a partial sum. The router and the shared-expert
gate are replicated (every rank routes the same way), the shared expert is split like a dense
MLP but not reduced on its own: the block adds the routed partial and the gated shared partial
(sigmoid(shared_expert_gate(x)) is one replicated scalar per token, so the gating commutes with
the sum over ranks) and all-reduces once.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.distributed.parallel_state import all_reduce, tp_size
from deltaserve.distributed.sharding import ShardRule, divide
from deltaserve.forward_context import ForwardContext
from deltaserve.layers.mlp import GatedMLP
from deltaserve.layers.weight_loading import Slot
from deltaserve.ops.moe import MoESpec


class MoEExperts(nn.Module):
    """The routed experts' weights: `w13` [E, 2I, H] (shards gate_proj, up_proj) and `w2`
    [E, H, I], each expert's tensors filling one slice of the stacked parameters.

    Under tensor parallelism I is this rank's share (`intermediate` / tp): w13 holds its rows of
    the gate projection, then its rows of the up projection, w2 the same columns. The rules cut
    the intermediate dimension counted from the end (-2 for w13, -1 for w2), so one rule serves
    a per-expert checkpoint tensor ([I, H], [H, I]) and a fused one ([E, 2I, H] made of the two
    pieces gate | up, [E, H, I]) alike."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        local = divide(intermediate, tp_size(), "moe_intermediate_size", "MoE expert width")
        self.stacked_experts = num_experts
        self.intermediate_size = local  # this rank's
        self.shard_offsets = {"gate_proj": (0, local), "up_proj": (local, local)}
        self.tp_rules = {
            ("w13", "gate_proj"): ShardRule(-2, (intermediate,)),
            ("w13", "up_proj"): ShardRule(-2, (intermediate,)),
            ("w13", None): ShardRule(-2, (intermediate, intermediate)),  # fused gate | up
            ("w2", None): ShardRule(-1, (intermediate,)),
        }
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * local, hidden))  # [E, 2I/tp, H]
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, local))  # [E, H, I/tp]

    def weight_slots(self, attr: str) -> list[Slot]:
        shards = list(self.shard_offsets) if attr == "w13" else [None]
        return [(shard, e) for e in range(self.stacked_experts) for shard in shards]


class SparseMoeBlock(nn.Module):
    """Router `gate` [E, H], experts, `shared_expert` (a GatedMLP) and `shared_expert_gate`
    [1, H]; called as `ffn(h, ctx)`. Under tensor parallelism one all-reduce per call (see the
    module docstring)."""

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
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # replicated
        self.experts = MoEExperts(num_experts, hidden, intermediate)
        # this rank's expert width: what the moe backend sees
        self.op_spec = MoESpec(num_experts, top_k, hidden, self.experts.intermediate_size)
        divide(
            shared_intermediate, tp_size(), "shared_expert_intermediate_size", "shared expert width"
        )
        self.shared_expert = GatedMLP(hidden, shared_intermediate, reduce_results=False)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)  # replicated

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] (replicated) -> [T, hidden] (summed over ranks)."""
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
        # both partial over ranks; sigmoid(...) [T, 1] is replicated, so it gates each partial
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ctx)
        return all_reduce(routed + shared)
