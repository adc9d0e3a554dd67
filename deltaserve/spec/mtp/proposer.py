"""MTPProposer: drafting with the target checkpoint's own MTP head (`mtp.*`, speculative
method "mtp"), behind the engine's `Proposer` interface (deltaserve/spec/proposer.py).

    LLM(model, speculative_config={"method": "mtp", "num_speculative_tokens": k})

The target builds and loads the head (`target.model.mtp`, deltaserve/models/mtp.py; the engine
asks for it when the method is "mtp"). The proposer reads the target's final-normed hidden
states (`tap_layer_ids = (FINAL_HIDDEN_TAP,)`: eager forwards and decode graphs keep them).

Life of a sequence:

- `observe(step)` after every target forward: for each kept position p whose next token is
  known (every kept position but the last of the row), the MTP K / V at p from (t_{p+1}, h_p)
  is written into the head's paged cache (blocks shared with the target,
  deltaserve/spec/draft_kv.py); the last kept position's hidden state is held back (`pending`)
  until its next token is known: the next step's first token, or at drafting time the token
  the target just sampled. Positions a verify step accepted overwrite what the chain computed
  from drafts: the cache only ever holds positions computed from the target's hidden states.
- `propose(seqs, max_drafts)`: for a row whose target computed 0 .. n - 1 and whose last token
  is t_n, the chain from (t_n, h_{n - 1}) (deltaserve/spec/mtp/drafter.py); rows grouped by
  their number of drafts. Drafts are the argmax of each step's logits, for greedy and sampled
  requests alike (deterministic drafts: q one-hot, which rejection sampling keeps exact).
- `release(seq)`: forget the pending hidden state (the KV blocks are the target's).

A prefix-cache hit starts a sequence's observed positions past 0: the MTP K / V of the hit's
blocks are whatever those blocks hold from when they were computed (drafts may be worse, the
output is unchanged: every draft is verified).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deltaserve.cache.planner import CachePlan
from deltaserve.cache.spec import AttentionSpec
from deltaserve.config import EngineConfig
from deltaserve.engine.sequence import Sequence
from deltaserve.forward_context import Kernels
from deltaserve.logger import get_logger
from deltaserve.spec.draft_kv import allocate_beside_target, block_table, slot_ids
from deltaserve.spec.mtp.checks import MTPConfigError
from deltaserve.spec.mtp.drafter import MTPDrafter, ragged_meta

if TYPE_CHECKING:
    from deltaserve.spec.mtp.graphs import ChainGraphs
from deltaserve.spec.proposer import FINAL_HIDDEN_TAP, Draft, Proposer, TargetStep

logger = get_logger(__name__)


@dataclass
class Pending:
    """The last observed position of a sequence, whose next token was not known then."""

    position: int
    hidden: torch.Tensor  # [H] the target's final-normed hidden state there


def _reference_kernels() -> Kernels:
    from deltaserve.ops.attention.reference import TorchAttentionBackend
    from deltaserve.ops.moe.reference import TorchMoE

    return Kernels(attention=TorchAttentionBackend(), moe=TorchMoE())


class MTPProposer(Proposer):
    """Drafts k tokens per step with the target's MTP head (`num_speculative_tokens` = k)."""

    tap_layer_ids = (FINAL_HIDDEN_TAP,)

    def __init__(self, spec: Any, config: EngineConfig) -> None:
        super().__init__(spec, config)
        self.drafter: MTPDrafter | None = None
        self.graphs: ChainGraphs | None = None
        self.pending: dict[int, Pending] = {}  # seq_id -> last observed position

    # ---- set-up ----------------------------------------------------------------------------
    def bind(self, target: Any) -> None:
        """Bind to the target's MTP head, embedding, lm_head and kernels (`target`: a
        ModelInstance, or a CausalLM in tests, which gets the torch reference kernels)."""
        model = target if isinstance(target, torch.nn.Module) else target.model
        head = getattr(model, "mtp", None)
        if head is None:
            raise MTPConfigError(
                f"speculative method 'mtp': the target {type(model).__name__} was built without "
                "its MTP head (build it with with_mtp=True)"
            )
        kernels = getattr(target, "kernels", None)
        if kernels is None:
            kernels = _reference_kernels()
        else:
            kernels = Kernels(attention=kernels.attention, fused=kernels.fused, moe=kernels.moe)
        self.drafter = MTPDrafter(head, model.model.embed_tokens, model.compute_logits, kernels)
        allocate_beside_target(self, target, self.config, "MTP head")

    def layer_specs(self) -> list[AttentionSpec]:
        """The head's cache spec (pool "paged"), to plan with the target's."""
        return self._bound().layer_specs()

    def allocate(self, plan: CachePlan, config: EngineConfig) -> None:
        """The head's K / V tensors: the plan's paged blocks (the target's block ids)."""
        self._bound().allocate(plan, config)

    def capture_graphs(self, max_batch: int, max_blocks: int, emulate: bool = False) -> None:
        """CUDA graphs of the greedy chain for k = num_speculative_tokens, up to `max_batch`
        rows whose block tables are at most `max_blocks` wide (the target's
        cdiv(max_model_len, block_size)). Groups of that k that fit replay them; rows drafting
        fewer (near max_tokens) and insertion run eagerly. `emulate`: no capture, the replays
        run eagerly (CPU tests)."""
        from deltaserve.spec.mtp.graphs import ChainGraphs

        k = self.spec.num_speculative_tokens
        self.graphs = ChainGraphs(self._bound(), max_batch, k, max_blocks, emulate)
        self.graphs.capture()
        logger.info(
            "MTP head: the greedy chain (k = %d) runs in CUDA graphs for batch buckets %s%s; "
            "rows drafting fewer than k and the insertion of verified positions run eagerly",
            k,
            self.graphs.buckets,
            " (emulated)" if emulate else "",
        )

    def _bound(self) -> MTPDrafter:
        if self.drafter is None:
            raise RuntimeError("MTPProposer.bind(target) must run before drafting")
        return self.drafter

    # ---- the engine's calls ----------------------------------------------------------------
    def observe(self, step: TargetStep) -> None:
        """Write the MTP K / V of every kept position whose next token is known; hold the last
        kept position of each row back (see the module docstring)."""
        drafter = self._bound()
        if not step.rows:
            return
        hidden = step.taps.get(FINAL_HIDDEN_TAP)
        if hidden is None:
            raise KeyError("the target step did not keep its final hidden states (MTP's tap)")
        bs = self.config.cache.block_size
        device = hidden.device
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        parts: list[torch.Tensor] = []  # [n, H] hidden states, in order
        query_lens, context_lens, tables = [], [], []
        for row in step.rows:
            if row.num_kept == 0:
                continue
            seq, first, kept = row.seq, row.first_position, row.num_kept
            rows = list(row.hidden_rows)
            start = first
            pend = self.pending.pop(seq.seq_id, None)
            n = 0
            if pend is not None and pend.position == first - 1:
                start = first - 1
                parts.append(pend.hidden[None])
                n += 1
            # positions start .. first + kept - 2 get their next token from the sequence
            if kept > 1:
                index = torch.as_tensor(rows[: kept - 1], dtype=torch.long, device=device)
                parts.append(hidden.index_select(0, index))
                n += kept - 1
            last = first + kept - 1
            self.pending[seq.seq_id] = Pending(last, hidden[rows[kept - 1]].clone())
            if n == 0:
                continue
            pos = range(start, last)
            tokens.extend(seq.token_ids[p + 1] for p in pos)
            positions.extend(pos)
            try:
                slots.extend(slot_ids(seq.block_ids, pos, bs))
            except RuntimeError as e:
                raise RuntimeError(f"sequence {seq.seq_id}: {e}") from e
            query_lens.append(n)
            context_lens.append(start)
            tables.append(seq.block_ids)
        if not query_lens:
            return
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        meta = ragged_meta(query_lens, context_lens, slot_mapping, block_table(tables, device))
        drafter.insert(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.cat(parts),
            torch.tensor(positions, dtype=torch.long, device=device),
            meta,
        )

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        """Greedy chain drafts for each of `seqs`, rows grouped by their number of drafts."""
        drafter = self._bound()
        out: list[Draft] = [Draft() for _ in seqs]
        for k in sorted(set(max_drafts)):
            if k < 1:
                continue
            idx = [i for i, ki in enumerate(max_drafts) if ki == k]
            tokens = self._propose_group(drafter, [seqs[i] for i in idx], k)
            for i, row in zip(idx, tokens, strict=True):
                out[i] = Draft(row)
        return out

    def _propose_group(self, drafter: MTPDrafter, seqs: list[Sequence], k: int) -> list[list[int]]:
        device = self.config.model.device
        bs = self.config.cache.block_size
        last, hidden, positions, slots, tables = [], [], [], [], []
        for seq in seqs:
            n = len(seq.token_ids) - 1  # positions the target computed
            pend = self.pending.get(seq.seq_id)
            if pend is None or pend.position != n - 1:
                have = "nothing" if pend is None else f"position {pend.position}"
                raise RuntimeError(
                    f"sequence {seq.seq_id}: the MTP proposer holds {have} but the sequence has "
                    f"{n + 1} tokens (expected position {n - 1}; was every target step observed?)"
                )
            last.append(seq.token_ids[-1])
            hidden.append(pend.hidden)
            positions.append(n - 1)
            slots.extend(slot_ids(seq.block_ids, [n - 1], bs))
            tables.append(seq.block_ids)
        args = (
            torch.tensor(last, dtype=torch.long, device=device),
            torch.stack(hidden),
            torch.tensor(positions, dtype=torch.long, device=device),
            torch.tensor(slots, dtype=torch.long, device=device),
            block_table(tables, device),
        )
        g = self.graphs
        if (
            g is not None
            and k == g.num_drafts
            and g.bucket(len(seqs)) is not None
            and args[-1].shape[1] <= g.max_blocks
        ):
            return g.replay(*args).tolist()
        tokens, _ = drafter.chain(*args, k)
        return tokens.tolist()

    def assume_context(self, seq: Sequence) -> None:
        """Benchmarks with synthetic contexts (deltaserve/bench/spec.py): treat the computed
        positions of `seq` as observed, the last one with a random hidden state (its MTP
        K / V are whatever the cache holds)."""
        drafter = self._bound()
        weight = drafter.head.fc.weight
        gen = torch.Generator(device=weight.device).manual_seed(seq.seq_id)
        h = torch.randn(weight.shape[0], generator=gen, device=weight.device).to(weight.dtype)
        self.pending[seq.seq_id] = Pending(seq.num_computed_tokens - 1, h)

    def release(self, seq: Sequence) -> None:
        """Forget the sequence's pending hidden state (its KV blocks are the target's)."""
        self.pending.pop(seq.seq_id, None)
