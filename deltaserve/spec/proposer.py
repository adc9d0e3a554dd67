"""The proposer interface: what every drafting method (ngram, DFlash, MTP, test stubs)
implements, and what the engine gives it.

One speculative step of the engine (engine/spec_step.py):

1. `propose(seqs, max_drafts)`: for each running sequence about to decode (its last token
   sampled, nothing pending), up to `max_drafts[i]` draft token ids (`Draft.token_ids`) and,
   for sampling drafters, their draft distributions `Draft.probs` [n, vocab] (q). A draft
   without probs is deterministic: q is one-hot at the draft token. The last accepted token is
   `seq.token_ids[-1]`; the drafts are appended after it (`seq.num_draft_tokens`).
2. The target verifies each row of 1 + k tokens in one forward; acceptance (engine/logits.py,
   spec/acceptance.py) keeps a prefix of the drafts plus one target token, rejected drafts are
   rolled back (KV, recurrent and conv state: spec/gdn_rollback.py).
3. `observe(step)`: after EVERY target forward that computed tokens of sequences (prefill
   chunks and verify rows), the rows that stay in the caches: for each sequence, its first
   computed position, how many of its computed tokens were kept (accepted; a verify row keeps
   1 + accepted, a prefill chunk all) and which rows of the step's hidden states they are. For
   a proposer that declares `tap_layer_ids`, `step.taps[layer]` holds the target's output hidden
   states (the residual stream after decoder layer `layer`, before the final norm) of every
   token of the step [T, hidden]; only `row.hidden_rows` of a sequence were kept. The tap id
   `FINAL_HIDDEN_TAP` (-1) is the hidden state AFTER the final norm (the lm_head's input; MTP
   reads it), kept by eager forwards and decode graphs alike without a second lm_head pass.
   A drafter that keeps per-position context (DFlash's context K/V) appends exactly those.
4. `release(seq)`: the sequence finished, was aborted or preempted (a preempted sequence is
   recomputed from its first token, and observed again): free what the proposer holds for it
   (e.g. its drafter KV blocks).

`bind(target)` is called once, after the target model is loaded and before the first step: a
drafter shares the target's embedding table and lm_head (`target.model`), its device and dtype.

A proposer is built as `Class(spec_config, engine_config)` from its method's registry entry
(spec/registry.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from deltaserve.config import EngineConfig
    from deltaserve.engine.sequence import Sequence
    from deltaserve.spec.config import SpeculativeConfig


# the tap id of the target's final-normed hidden state (TargetStep.taps[FINAL_HIDDEN_TAP])
FINAL_HIDDEN_TAP = -1


@dataclass
class Draft:
    """Up to k proposed tokens for one sequence. probs: [len(token_ids), vocab] float, each row
    the draft distribution q the token was sampled from; None: deterministic drafts (q one-hot,
    as prompt lookup and greedy drafters)."""

    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None


@dataclass
class ComputedRow:
    """The tokens of one sequence a target step computed and kept.

    positions `first_position .. first_position + num_kept - 1` are now in the target's caches;
    their hidden states are rows `hidden_rows` of the step's [T, hidden] tensors."""

    seq: Sequence
    first_position: int
    num_kept: int
    hidden_rows: range


@dataclass
class TargetStep:
    """One target forward, as a proposer sees it after acceptance."""

    rows: list[ComputedRow]
    taps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, hidden]


class Proposer(ABC):
    """A drafting method. Subclasses set `tap_layer_ids` when they read the target's hidden
    states and implement `propose`; `observe`, `bind` and `release` default to nothing."""

    # 0-based target decoder layers whose outputs the proposer reads (TargetStep.taps), or
    # FINAL_HIDDEN_TAP for the final-normed hidden state
    tap_layer_ids: tuple[int, ...] = ()

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig) -> None:
        self.spec = spec
        self.config = config

    def bind(self, target: Any) -> None:
        """The target `ModelInstance` is loaded (its model, device, dtype)."""
        return None

    def observe(self, step: TargetStep) -> None:
        """The target computed and kept the tokens of `step.rows` (see the module docstring)."""
        return None

    @abstractmethod
    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> list[Draft]:
        """For each of `seqs` (about to decode), at most `max_drafts[i]` (>= 1) drafts."""

    def release(self, seq: Sequence) -> None:
        """`seq` finished, was aborted or preempted: free what the proposer holds for it."""
        return None


def build_proposer(spec: SpeculativeConfig, config: EngineConfig) -> Proposer:
    """The proposer of `spec.method` (spec/registry.py)."""
    from deltaserve.spec.registry import PROPOSER_METHODS

    cls = PROPOSER_METHODS[spec.method].load()
    proposer = cls(spec, config)
    if not isinstance(proposer, Proposer):
        raise TypeError(f"proposer method {spec.method!r} built {type(proposer).__name__}")
    return proposer
