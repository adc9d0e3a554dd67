"""One step on a tensor-parallel rank other than 0: the collectives of rank 0's step.

Rank 0 samples; the other ranks run the same forward and lm_head calls from the `StepInput` it
broadcasts, so that every collective pairs up: the decode graph of the bucket rank 0 replays
(checked: this rank must pick the same bucket for the same rows), or the eager forward; after an
overlapped step, the sampled ids rank 0 broadcasts on the device group, from which the next
step's pending tokens come.
"""

from __future__ import annotations

import torch

from deltaserve.distributed.parallel_state import broadcast_tensor, tp_rank
from deltaserve.engine.logits import iter_logits
from deltaserve.engine.step_prep import StepInput


def run_worker_step(runner, step: StepInput) -> None:
    """Run rank 0's `step` on this rank's `runner` (a ModelRunner)."""
    runner.apply_cache_ops(step.cache_ops)
    prev_ids = runner._peer_sampled_ids if step.prev_rows is not None else None
    input_ids, positions, meta = runner.stager.tensors(step, prev_ids)
    inst = runner.instance
    if step.graph_bucket is not None:
        mine = inst.graph_bucket(meta.num_seqs, meta.decode_query_len)
        if mine != step.graph_bucket:
            raise RuntimeError(
                f"tensor-parallel rank {tp_rank()} out of lockstep: rank 0 replays the decode "
                f"graph of bucket {step.graph_bucket} for {meta.num_seqs} rows, this rank picks "
                f"{mine}"
            )
        inst.replay(input_ids, positions, meta)
    elif step.shares_sampled_ids:  # an overlapped eager step: the lm_head over every row
        inst.compute_logits(inst.forward(input_ids, positions, meta))
    else:
        hidden = inst.forward(input_ids, positions, meta)
        for _ in iter_logits(inst, hidden, step):
            pass
    if step.shares_sampled_ids:
        ids = torch.empty(len(step.seq_lens), dtype=torch.long, device=runner.device)
        runner._peer_sampled_ids = broadcast_tensor(ids)
