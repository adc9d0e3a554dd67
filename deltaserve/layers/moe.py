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
gate rows of the fused `in_proj` are replicated (every rank routes the same way), its shared
gate/up rows split like a dense MLP's; the shared down projection is not reduced on its own:
the `moe` op adds the routed partial and the gated shared partial (sigmoid(shared_expert_gate(x))
is one replicated scalar per token, so the gating commutes with the sum over ranks) and the
block all-reduces once.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.distributed.parallel_state import all_reduce, tp_size
from deltaserve.distributed.sharding import ShardRule, divide
from deltaserve.forward_context import ForwardContext
from deltaserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from deltaserve.layers.weight_loading import Slot
from deltaserve.ops.linear import NormedInput
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


class RouterLogits(nn.Module):
    """The router's hook point: the identity on the router logits [T, E] (the router's rows
    live in the block's fused `in_proj`). `bench throughput`'s routing recorder hooks its output;
    tests swap in a module that returns forced logits of the same shape."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class SparseMoeBlock(nn.Module):
    """A MoE block, called as `ffn(h, ctx)`.

    `in_proj` is one column-parallel projection for everything that reads x, filled from four
    checkpoint tensors (model rules map `mlp.shared_expert.gate_proj` / `up_proj`, `mlp.gate`
    and `mlp.shared_expert_gate` to its shards): [shared gate_proj (Is/tp) | shared up_proj
    (Is/tp) | router (E, replicated) | shared_expert_gate (1, replicated)], so a decode step
    reads x once in one GEMM. The shared expert's gate/up rows come first; the router logits
    (activation dtype, as HF's nn.Linear gives them) pass through `gate` to the `moe` op, which
    routes (softmax in float32), runs the shared expert from its gate/up outputs and
    `shared_down`'s weight (the Triton decode path inside its own down kernel: no launches of
    the shared expert's own) and combines routed + sigmoid(shared gate logit) * shared expert
    in one pass. `shared_down` holds the shared expert's down projection (this rank's columns
    under tensor parallelism; the op leaves the sum partial). One all-reduce per call (see the
    module docstring)."""

    kernel_family = "moe"  # its kernels: graph-safe where the moe backend says so

    partial_output = "self"  # parallel_linear.leave_output_partial
    # decoder.normed_input: in_proj may form the input; the experts then read its copy
    normed_input_projection = "in_proj"
    rereads_input = True

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
        self.reduce_results = True  # False: the caller all-reduces (partial_output)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.experts = MoEExperts(num_experts, hidden, intermediate)
        # this rank's expert width: what the moe backend sees
        self.op_spec = MoESpec(num_experts, top_k, hidden, self.experts.intermediate_size)
        divide(
            shared_intermediate, tp_size(), "shared_expert_intermediate_size", "shared expert width"
        )
        self.in_proj = ColumnParallelLinear(
            hidden,
            {
                "shared_gate_proj": shared_intermediate,
                "shared_up_proj": shared_intermediate,
                "gate": num_experts,
                "shared_expert_gate": 1,
            },
            replicated=("gate", "shared_expert_gate"),
        )
        self.gate = RouterLogits()
        self.shared_down = RowParallelLinear(
            shared_intermediate, hidden, bias=False, reduce_results=False
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] (replicated) -> [T, hidden] (summed over ranks)."""
        moe = ctx.kernels.moe
        if moe is None:
            raise RuntimeError("a MoE layer ran without a moe backend (Kernels.moe is None)")
        y = self.in_proj(x)  # [T, 2 Is/tp + E + 1]
        if isinstance(x, NormedInput):  # in_proj formed the input (decoder.normed_input)
            x = x.normed_out
        offsets = self.in_proj.shard_offsets
        shared_width = 2 * offsets["shared_gate_proj"][1]
        router_at, num_experts = offsets["gate"]
        gate_at = offsets["shared_expert_gate"][0]
        # routed and shared partial over ranks; sigmoid(shared gate logit) [T, 1] is replicated,
        # so it gates each partial; the op runs the shared expert's SiLU-and-mul and down
        # projection itself (inside its decode kernels where it can) and sums in float32
        out = moe(
            x,
            self.experts.w13,
            self.experts.w2,
            router_logits=self.gate(y[:, router_at : router_at + num_experts]),
            top_k=self.top_k,
            renormalize=self.norm_topk_prob,
            shared_gate=y[:, gate_at : gate_at + 1],
            shared_gate_up=y[:, :shared_width],
            shared_down=self.shared_down.weight,
        )
        return all_reduce(out) if self.reduce_results else out
