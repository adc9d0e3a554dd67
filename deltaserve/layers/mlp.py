"""The gated MLP (SwiGLU feed-forward) of dense decoder layers."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.forward_context import ForwardContext
from deltaserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul (`gate_up_proj`, filled
    from the checkpoint's gate_proj and up_proj). Under tensor parallelism each rank holds a
    slice of the intermediate features (gate and up column-split, down row-split and summed
    over ranks; with `reduce_results=False` the sum is left to the caller, which all-reduces
    once: a MoE block's shared expert).

    Called as `ffn(h, ctx)`, like every feed-forward block of a decoder layer (a MoE block
    reaches its kernels through `ctx.kernels`)."""

    partial_output = "down_proj"  # parallel_linear.leave_output_partial
    normed_input_projection = "gate_up_proj"  # decoder.normed_input

    def __init__(self, hidden: int, intermediate: int, reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden, {"gate_proj": intermediate, "up_proj": intermediate}
        )
        self.down_proj = RowParallelLinear(
            intermediate, hidden, bias=False, reduce_results=reduce_results
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(ctx.kernels.fused.silu_and_mul(self.gate_up_proj(x)))
