"""The DeepSeek-V2 MoE block: a float32 router with greedy or group-limited top-k, routed
experts, and ungated shared experts.

`output = experts(x; deepseek_route(gate(x))) + shared_experts(x)` (HF's modeling_deepseek_v2
`DeepseekV2Moe`): the router logits are `F.linear` of x and `mlp.gate.weight` in float32, the
routing is deltaserve.ops.moe.grouped_topk's (scores times routed_scaling_factor, no
renormalisation), the `n_shared_experts` shared experts are one gated MLP of
`moe_intermediate_size * n_shared_experts` added without a gate. Greedy routing without
norm_topk_prob (the released V2 configs) is the `moe` op's own (router logits and
`routed_scaling_factor` passed to it: one routing launch, none at batch 1 on the Triton decode
path); group-limited routing and the renormalising variant are routed in torch first.

Checkpoint names: `mlp.gate.weight` [E, H], `mlp.experts.{e}.{gate,up,down}_proj.weight` (the
released per-expert layout; fused `experts.gate_up_proj` / `down_proj` load too),
`mlp.shared_experts.{gate,up,down}_proj.weight`. Tensor parallelism as for Qwen's MoE block
(deltaserve.layers.moe): experts' and shared expert's intermediate dimension split, router
replicated, one all-reduce of the routed + shared partials.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.distributed.parallel_state import all_reduce, tp_size
from deltaserve.distributed.sharding import divide
from deltaserve.forward_context import ForwardContext
from deltaserve.layers.moe import MoEExperts
from deltaserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from deltaserve.ops.linear import NormedInput
from deltaserve.ops.moe import MoEBackend, MoESpec, router_logits_torch
from deltaserve.ops.moe.grouped_topk import ROUTING_METHODS, deepseek_route


class Router(nn.Module):
    """The router's weight [E, H] (replicated under tensor parallelism); logits in float32."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Keep the weight in float32 (an exact upcast of the checkpoint's): HF upcasts it at
        every call, which on the GPU is one more kernel per layer and step."""
        if self.weight.dtype != torch.float32:
            self.weight = nn.Parameter(self.weight.float(), requires_grad=False)

    def forward(self, x: torch.Tensor, moe: MoEBackend | None = None) -> torch.Tensor:
        """x [T, H] -> router logits [T, E] float32, by the `moe` backend's float32 router
        kernel (`router_logits`), or torch's F.linear (HF's computation) without one."""
        if moe is not None:
            return moe.router_logits(x, self.weight)
        return router_logits_torch(x, self.weight)


class DeepseekMoeBlock(nn.Module):
    """A DeepSeek-V2 MoE block, called as `ffn(h, ctx)`. `shared_in_proj` holds the shared
    experts' gate and up rows ([gate | up], this rank's), `shared_down` their down projection
    (handed to the `moe` op, which adds the shared term ungated; its sum is left partial)."""

    kernel_family = "moe"  # its kernels: graph-safe where the moe backend says so

    partial_output = "self"  # parallel_linear.leave_output_partial
    # decoder.normed_input: with shared experts, shared_in_proj may form the input; the router
    # and the routed experts then read its copy
    normed_input_projection = "shared_in_proj"
    rereads_input = True

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        num_shared_experts: int,
        topk_method: str = "greedy",
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        norm_topk_prob: bool = False,
    ) -> None:
        super().__init__()
        self.reduce_results = True  # False: the caller all-reduces (partial_output)
        if topk_method not in ROUTING_METHODS:
            raise ValueError(f"topk_method {topk_method!r} is not supported: {ROUTING_METHODS}")
        if topk_method == "group_limited_greedy" and (
            not n_group or not topk_group or num_experts % n_group or topk_group > n_group
        ):
            raise ValueError(
                f"group_limited_greedy needs n_group dividing n_routed_experts ({num_experts}) "
                f"and topk_group <= n_group; got n_group={n_group}, topk_group={topk_group}"
            )
        self.top_k = top_k
        self.topk_method = topk_method
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        # NOTE: greedy without renormalisation is the `moe` op's own routing rule given
        # routed_scaling_factor (the same ids and float32 weights as `route`)
        self.routes_in_op = topk_method == "greedy" and not norm_topk_prob
        self.experts = MoEExperts(num_experts, hidden, intermediate)
        self.op_spec = MoESpec(num_experts, top_k, hidden, self.experts.intermediate_size)
        self.gate = Router(num_experts, hidden)
        self.has_shared = num_shared_experts > 0
        if self.has_shared:
            shared = intermediate * num_shared_experts
            divide(shared, tp_size(), "moe_intermediate_size * n_shared_experts", "shared width")
            self.shared_in_proj = ColumnParallelLinear(
                hidden, {"shared_gate_proj": shared, "shared_up_proj": shared}
            )
            self.shared_down = RowParallelLinear(shared, hidden, bias=False, reduce_results=False)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (topk_ids, topk_weights) [T, k] by this block's rule (also
        what bench/routing.py's recorder calls on the router's output)."""
        return deepseek_route(
            router_logits,
            self.top_k,
            self.topk_method,
            self.n_group,
            self.topk_group,
            self.routed_scaling_factor,
            self.norm_topk_prob,
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] (replicated) -> [T, hidden] (summed over ranks)."""
        moe = ctx.kernels.moe
        if moe is None:
            raise RuntimeError("a MoE layer ran without a moe backend (Kernels.moe is None)")
        shared = {}
        if self.has_shared:  # first: it may form x (decoder.normed_input)
            shared = dict(
                shared_gate_up=self.shared_in_proj(x), shared_down=self.shared_down.weight
            )
            if isinstance(x, NormedInput):
                x = x.normed_out
        router_logits = self.gate(x, moe)  # [T, E] float32
        if self.routes_in_op:
            routing = dict(
                router_logits=router_logits,
                top_k=self.top_k,
                routed_scaling_factor=self.routed_scaling_factor,
            )
        else:
            ids, weights = self.route(router_logits)  # [T, k] int64, [T, k] float32
            routing = dict(topk_ids=ids, topk_weights=weights)
        out = moe(x, self.experts.w13, self.experts.w2, **routing, **shared)
        return all_reduce(out) if self.reduce_results else out
