"""The model runner's side of speculative decoding: the GDN scratch of a step with drafts, the
rollback and the proposer's view of a step after acceptance, and the start-up log line of what
runs in CUDA graphs. The methods themselves live in deltaserve.spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltaserve.engine.logits import RunnerOutput
from deltaserve.engine.step_prep import StepInput
from deltaserve.logger import get_logger

if TYPE_CHECKING:  # a runtime import would be circular
    from deltaserve.engine.model_runner import ModelRunner

logger = get_logger(__name__)


def log_spec_graphs(graphs: Any, tap_layers: tuple[int, ...]) -> None:
    """Say which speculative steps replay the target's decode graphs (`graphs`: DecodeGraphs)."""
    taps = ""
    if tap_layers:
        from deltaserve.spec.proposer import FINAL_HIDDEN_TAP

        names = [
            "the final hidden state" if i == FINAL_HIDDEN_TAP else f"layer {i}" for i in tap_layers
        ]
        taps = f", keeping the target's {', '.join(names)}"
    logger.info(
        "speculative decoding: target steps whose rows all carry q in %s tokens replay "
        "CUDA graphs (batch buckets %s%s%s); steps mixing rows with and without drafts, "
        "or with prefill chunks, run eagerly",
        list(graphs.query_lens),
        graphs.buckets,
        ", emulated" if graphs.emulate else "",
        taps,
    )


def verify_scratch(gdn_rollback: Any, items: list, step: StepInput) -> Any:
    """The GDN scratch of a step whose rows carry drafts (None: no drafts or no GDN)."""
    if gdn_rollback is None:
        return None
    rows = []
    for b, row in enumerate(items):
        if row.num_draft:
            if not row.is_decode:
                raise RuntimeError(f"{row}: drafts are verified only in decode rows")
            rows.append((step.query_start_loc[b], row[1], row[0].state_slot))
    return gdn_rollback.scratch(rows) if rows else None


def after_verify(
    runner: ModelRunner, items: list, step: StepInput, out: RunnerOutput, gdn: bool
) -> None:
    """Roll the GDN states of rows that rejected drafts back to their accepted tokens, and
    describe what the step kept for the proposer (`out.target_step`)."""
    from deltaserve.spec.gdn_rollback import RollbackRow
    from deltaserve.spec.proposer import ComputedRow, TargetStep

    rollback, kept_rows, r = [], [], 0
    for b, (seq, n) in enumerate(items):
        rejected = out.num_rejected.get(seq.seq_id, 0)
        kept = n - rejected
        if items[b].num_draft:
            if rejected:
                rollback.append(RollbackRow(r, kept, seq.state_slot))
            r += 1
        start = step.query_start_loc[b]
        kept_rows.append(
            ComputedRow(seq, seq.num_computed_tokens, kept, range(start, start + kept))
        )
    if gdn and rollback:
        runner.gdn_rollback.rollback(rollback)
    taps = runner.instance.last_hidden_states if runner.tap_layers else {}
    out.target_step = TargetStep(kept_rows, taps)
