"""Stub proposers for the speculative-decoding tests and benchmarks, registered as methods.

Each reads `options["continuations"]`: prompt (tuple of ids) -> the target's own greedy output
(from a run without speculation), and drafts from it:
- "oracle": the true continuation (every draft is accepted);
- "anti_oracle": every draft wrong (none accepted);
- "truncated_oracle": the first `options["j"]` drafts right, then wrong ones (exactly j).

With `options["tap_layer_ids"]` a stub reads the target's hidden states as DFlash does: the
engine must hand it those layers' outputs after every target step (graph replays included),
and it keeps each kept position's taps in `seen` ((prompt, position) -> [n_taps, hidden]).
"""

from __future__ import annotations

import torch

from deltaserve.spec.proposer import Draft, Proposer, TargetStep
from deltaserve.spec.registry import ProposerMethod, register_proposer


def wrong(token: int, vocab: int = 200) -> int:
    return (token + 1) % vocab + 3 if token + 1 < vocab - 3 else 3


class OracleProposer(Proposer):
    num_right: int | None = None  # None: all right

    def __init__(self, spec, config) -> None:
        super().__init__(spec, config)
        self.table = {tuple(p): list(c) for p, c in spec.options["continuations"]}
        self.calls = 0
        self.tap_layer_ids = tuple(spec.options.get("tap_layer_ids", ()))
        self.seen: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}

    def observe(self, step: TargetStep) -> None:
        if not self.tap_layer_ids:
            return
        for row in step.rows:
            prompt = tuple(row.seq.prompt_token_ids)
            positions = range(row.first_position, row.first_position + row.num_kept)
            for p, r in zip(positions, row.hidden_rows, strict=True):
                taps = [step.taps[i][r] for i in self.tap_layer_ids]  # KeyError: a tap missing
                self.seen[(prompt, p)] = torch.stack(taps).float().cpu()

    def right(self) -> int | None:
        return self.num_right

    def propose(self, seqs, max_drafts):
        self.calls += 1
        out = []
        for seq, k in zip(seqs, max_drafts, strict=True):
            full = list(seq.prompt_token_ids) + self.table[tuple(seq.prompt_token_ids)]
            pos = len(seq.token_ids)
            assert seq.token_ids == full[:pos], "the proposer saw tokens the target did not emit"
            drafts = full[pos : pos + k]
            j = self.right()
            if j is not None:
                drafts = drafts[:j] + [wrong(t) for t in drafts[j:]]
            out.append(Draft(drafts))
        return out


class AntiOracleProposer(OracleProposer):
    def right(self) -> int | None:
        return 0


class TruncatedOracleProposer(OracleProposer):
    def right(self) -> int | None:
        return self.spec.options["j"]


for name, cls, keys in (
    ("oracle", OracleProposer, ("continuations", "tap_layer_ids")),
    ("anti_oracle", AntiOracleProposer, ("continuations", "tap_layer_ids")),
    ("truncated_oracle", TruncatedOracleProposer, ("continuations", "j", "tap_layer_ids")),
):
    register_proposer(ProposerMethod(name, cls, keys=keys))
