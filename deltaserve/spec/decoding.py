"""The engine's side of speculative decoding: drafts in before scheduling, bookkeeping after.

Per engine step (engine/llm_engine.py, synchronous steps only):

1. `propose(scheduler)`: for each running sequence about to decode (its last token sampled,
   nothing pending), the proposer's drafts are appended to `seq.token_ids`
   (`seq.num_draft_tokens`), at most k and never past max_tokens or max_model_len. Drafts are
   given only while every running row fits the token budget whole, so a row with drafts is
   always scheduled whole (its drafts verified in one step) or not at all.
2. the scheduler schedules 1 + k tokens for such a row (one rule: drafts are tokens);
   `after_schedule` strips the drafts of preempted sequences (they restart from scratch).
3. the runner verifies (engine/logits.py accepts), rolls the GDN states of rejected drafts back
   (spec/gdn_rollback.py); `Scheduler.advance` rolls KV and token ids back.
4. `after_step`: acceptance statistics, and the proposer observes what the step kept.

Drafts that were not scheduled (the budget or a preemption left their row out) are stripped
before the next proposal.
"""

from __future__ import annotations

from deltaserve.config import EngineConfig
from deltaserve.engine.logits import RunnerOutput
from deltaserve.engine.scheduler import ScheduledBatch, Scheduler
from deltaserve.engine.sequence import Sequence
from deltaserve.logger import get_logger
from deltaserve.spec.proposer import Proposer
from deltaserve.spec.stats import SpecStats

logger = get_logger(__name__)


def strip_drafts(seq: Sequence) -> None:
    """Remove `seq`'s drafts if none of them is computed (a row left out of a step)."""
    nd = seq.num_draft_tokens
    if not nd:
        return
    first_draft = len(seq.token_ids) - nd
    if seq.num_computed_tokens > first_draft:
        raise RuntimeError(f"{seq}: drafts computed without being verified")
    del seq.token_ids[first_draft:]
    seq.num_draft_tokens = 0
    seq.draft_probs = None


class SpecDecoder:
    """A proposer and its bookkeeping around the engine's steps."""

    def __init__(self, config: EngineConfig, runner, scheduler: Scheduler) -> None:
        spec = config.speculative
        assert spec is not None
        self.config = config
        self.k = spec.num_speculative_tokens
        # the runner built and bound it (a drafter's caches are planned with the target's)
        self.proposer: Proposer = runner.proposer
        # NOTE: the runner keeps the proposer's taps from start-up (its graphs capture them)
        assert runner.tap_layers == tuple(self.proposer.tap_layer_ids)
        scheduler.release_hooks.append(self.proposer.release)
        self.stats = SpecStats(self.k)
        logger.info(
            "speculative decoding: %s, up to %d draft tokens per step (overlapped decode off)",
            spec.method,
            self.k,
        )

    def propose(self, scheduler: Scheduler) -> None:
        """Append drafts to the running sequences about to decode (see the module docstring)."""
        budget = scheduler.config.max_num_batched_tokens
        max_len = self.config.model.max_model_len
        seqs, limits = [], []
        used = 0
        for seq in scheduler.running:
            strip_drafts(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            decoding = remaining == 1 and seq.num_computed_tokens > 0
            if decoding and not seq.num_pending_tokens:
                left_out = seq.params.max_tokens - seq.num_output_tokens  # incl. this step's
                k = min(self.k, budget - used - 1, left_out - 1, max_len - seq.num_tokens - 1)
                if k >= 1:
                    seqs.append(seq)
                    limits.append(k)
                    used += k
            used += remaining
        if not seqs:
            return
        drafts = self.proposer.propose(seqs, limits)
        for seq, k, draft in zip(seqs, limits, drafts, strict=True):
            tokens = list(draft.token_ids[:k])
            if tokens:
                seq.token_ids.extend(tokens)
                seq.num_draft_tokens = len(tokens)
                seq.draft_probs = None if draft.probs is None else draft.probs[: len(tokens)]

    def after_schedule(self, batch: ScheduledBatch) -> None:
        for seq in batch.preempted:
            strip_drafts(seq)  # recomputed from scratch: drafts come again later

    def after_step(self, batch: ScheduledBatch, out: RunnerOutput) -> None:
        """Count the verified drafts; show the proposer what the step kept."""
        for row in batch.items:
            if row.num_draft:
                rejected = out.num_rejected.get(row[0].seq_id, 0)
                self.stats.record(row.num_draft, row.num_draft - rejected)
                row[0].draft_probs = None
        if out.target_step is not None:
            self.proposer.observe(out.target_step)
