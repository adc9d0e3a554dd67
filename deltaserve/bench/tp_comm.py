"""Tensor parallelism's communication per decode step, measured beside the throughput rows.

For each decode row of B sequences at context L: the all-reduces of one decode step (the count
the engine's own forwards make, each of [B, hidden] in the model's dtype, on the device group,
in one CUDA graph, every rank together: deltaserve.distributed.collective_bench; where the
one-shot kernel serves them, NCCL's time for the same all-reduces too), and the cost
on rank 0's host of sending one step description of that size over the gloo control channel.
The logits' all-gather (one per step) is not included.
"""

from __future__ import annotations

import torch

from deltaserve.distributed import parallel_state
from deltaserve.distributed.collective_bench import AllReduceStep, ControlMessage, run_on_all_ranks
from deltaserve.engine.step_prep import StepInput


class AllReduceCounter:
    """All-reduces per eager forward, counted over the forwards run between `start` and
    `stop` (the bench's prefill rows: every forward makes the same ones)."""

    def __init__(self, engine) -> None:
        self.instance = engine.runner.instance
        self.calls = parallel_state.ALL_REDUCE_CALLS[0]
        self.at_norms = parallel_state.NORM_REDUCE_CALLS[0]
        self.forwards = self.instance.num_eager_forwards

    def per_forward(self) -> int | None:
        forwards = self.instance.num_eager_forwards - self.forwards
        if forwards == 0:
            return None
        calls = parallel_state.ALL_REDUCE_CALLS[0] - self.calls
        return round(calls / forwards)

    def at_norms_per_forward(self) -> int:
        """Of per_forward(), those made at a norm (fused with it where decode's fit)."""
        forwards = self.instance.num_eager_forwards - self.forwards
        calls = parallel_state.NORM_REDUCE_CALLS[0] - self.at_norms
        return round(calls / forwards) if forwards else 0


def decode_step_message(batch: int, context: int, block_size: int) -> StepInput:
    """A step description like the one rank 0 sends for a decode step of `batch` rows at
    `context` tokens."""
    blocks = -(-(context + 1) // block_size)
    return StepInput(
        token_ids=list(range(batch)),
        positions=[context] * batch,
        slot_mapping=torch.arange(batch, dtype=torch.int64),
        query_start_loc=list(range(batch + 1)),
        seq_lens=[context + 1] * batch,
        context_lens=[context] * batch,
        state_slots=list(range(1, batch + 1)),
        block_tables=torch.arange(batch * blocks, dtype=torch.int64).reshape(batch, blocks),
        num_decodes=batch,
        logits_rows=[range(batch)],
    )


def add_comm_costs(
    engine, rows: list[dict], all_reduces_per_step: int | None, at_norms: int = 0
) -> None:
    """Add to every decode row the all-reduce time of one step (and its share of the measured
    median step) and the control message's cost; the engine must be idle. `at_norms` of the
    step's all-reduces are made at norms: timed fused with the residual add and RMSNorm where
    that kernel is installed (the time then includes those norms)."""
    cfg = engine.config
    if cfg.tensor_parallel_size == 1:
        return
    device = engine.runner.device
    hidden = cfg.model.text_config.hidden_size
    for row in rows:
        if row["kind"] != "decode":
            continue
        batch = row["batch"]
        if all_reduces_per_step:
            task = AllReduceStep(
                batch, hidden, cfg.model.dtype, all_reduces_per_step, at_norms=at_norms
            )
            seconds = run_on_all_ranks(task, device)
            row["all_reduces_per_step"] = all_reduces_per_step
            if parallel_state.fused_norm_installed():
                row["allreduce_fused_with_norm"] = at_norms
            row["allreduce_us_per_step"] = seconds * 1e6
            row["allreduce_pct_of_step"] = 100.0 * seconds / row["step_s_median"]
            if parallel_state.small_all_reduce_installed():  # what NCCL alone would take
                nccl = AllReduceStep(
                    batch, hidden, cfg.model.dtype, all_reduces_per_step, small_kernel=False
                )
                row["nccl_allreduce_us_per_step"] = run_on_all_ranks(nccl, device) * 1e6
        message = decode_step_message(batch, row["length"], cfg.cache.block_size)
        row["control_us_per_step"] = run_on_all_ranks(ControlMessage(message), device) * 1e6


def comm_note(row: dict) -> str:
    """The table's note for a decode row's communication ('' without TP)."""
    parts = []
    if "allreduce_us_per_step" in row:
        parts.append(
            f"all-reduce {row['allreduce_us_per_step']:,.0f} us/step "
            f"({row['all_reduces_per_step']} x [B, hidden]"
            + (
                f", {row['allreduce_fused_with_norm']} of them fused with the residual add + "
                "RMSNorm, their time included"
                if row.get("allreduce_fused_with_norm")
                else ""
            )
            + ", "
            f"{row['allreduce_pct_of_step']:.0f}% of the step)"
        )
    if "nccl_allreduce_us_per_step" in row:
        parts.append(f"NCCL alone {row['nccl_allreduce_us_per_step']:,.0f} us/step")
    if "control_us_per_step" in row:
        parts.append(f"control message {row['control_us_per_step']:,.0f} us")
    return "; ".join(parts)
