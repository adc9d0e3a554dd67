"""The routing of real decode steps, for a MoE model's decode floor (`bench throughput`).

A MoE decode step streams only the experts its tokens selected: per MoE layer, the number of
DISTINCT experts among the batch's top-k sets. `RoutingRecorder` collects it on the device:
a forward hook on each MoE block's router routes the router logits exactly as the `moe`
backends do (deltaserve.ops.moe.route, or the block's own `route`: DeepSeek's group-limited
rule) and marks the selected experts in a per-layer bitmap [num MoE layers, E]; at the end of
each step the bitmap's row counts are added to a running sum and the bitmap is cleared.
Nothing is read back to the host until `mean_distinct()`.

The hooks run in eager forwards only, and they add kernels to the step, so the steps that are
timed are not recorded: `record_decode_routing` runs further pure decode steps of the same
sequences right after the timed ones (untimed, eagerly: CUDA graphs set aside while it runs)
and returns, per MoE layer, the mean number of distinct experts they selected.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from deltaserve.bench.floors import moe_blocks
from deltaserve.ops.moe import route


class RoutingRecorder:
    """Per MoE layer of `model` (in layer order), the distinct experts each recorded step
    selected, accumulated on the device. Use as a context manager (it holds the hooks) and
    call `end_step()` after each step's forward."""

    def __init__(self, model: nn.Module) -> None:
        self.blocks = moe_blocks(model)
        if not self.blocks:
            raise ValueError("the model has no MoE layers: there is no routing to record")
        device = next(model.parameters()).device
        width = max(b.op_spec.num_experts for b in self.blocks)
        self.bitmap = torch.zeros(len(self.blocks), width, dtype=torch.bool, device=device)
        self.distinct_sum = torch.zeros(len(self.blocks), dtype=torch.int64, device=device)
        self.steps = 0
        self._hooks: list = []

    def _hook(self, layer: int):
        block = self.blocks[layer]

        def mark(module: nn.Module, inputs, router_logits: torch.Tensor) -> None:
            if hasattr(block, "route"):  # a block with its own rule (DeepSeek: group-limited)
                ids, _ = block.route(router_logits)
            else:
                ids, _ = route(
                    router_logits, block.top_k, block.norm_topk_prob, router_logits.dtype
                )
            self.bitmap[layer].index_fill_(0, ids.reshape(-1), True)  # no host sync

        return mark

    def __enter__(self) -> RoutingRecorder:
        self._hooks = [
            b.gate.register_forward_hook(self._hook(i)) for i, b in enumerate(self.blocks)
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def end_step(self) -> None:
        """Close one step: add each layer's count of selected experts, clear the bitmap."""
        self.distinct_sum += self.bitmap.sum(dim=-1)
        self.bitmap.zero_()
        self.steps += 1

    def mean_distinct(self) -> list[float]:
        """Mean distinct experts per step, one value per MoE layer (reads the device once)."""
        if self.steps == 0:
            raise RuntimeError("no step was recorded")
        return [n / self.steps for n in self.distinct_sum.tolist()]


@contextmanager
def eager_forwards(runner):
    """Run the runner's steps without its CUDA graphs while inside (bench only): neither the
    decode graphs nor the piecewise graphs of short eager steps, whose replays would hide the
    routers' calls from the recorder."""
    instance = runner.instance
    graphs, instance.graphs = instance.graphs, None
    piecewise, instance.piecewise = instance.piecewise, None
    try:
        yield
    finally:
        instance.graphs = graphs
        instance.piecewise = piecewise


def record_decode_routing(engine, seqs: list, steps: int) -> list[float]:
    """Run `steps` more pure decode steps of `seqs` (all running, decoding, alone in the
    engine) with routing recorded; per MoE layer, the mean distinct experts per step.

    Raises RuntimeError when a step was not a pure decode step of all of them."""
    if steps < 1:
        raise ValueError("record at least one step")
    runner = engine.runner
    before = [s.num_output_tokens for s in seqs]
    with eager_forwards(runner), RoutingRecorder(runner.model) as recorder:
        for _ in range(steps):
            engine.step()
            recorder.end_step()
        distinct = recorder.mean_distinct()  # syncs: every recorded forward has run
    gained = {s.num_output_tokens - b for s, b in zip(seqs, before)}
    # with overlapped decode the last step's tokens are still pending: at most one short
    if not gained <= {steps, steps - 1} or any(s.is_finished for s in seqs):
        raise RuntimeError(
            f"routing: the {len(seqs)} sequences gained {sorted(gained)} tokens in {steps} "
            "recorded steps; they were not all pure decode steps"
        )
    return distinct
