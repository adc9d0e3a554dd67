"""DFlashProposer's bookkeeping over the Proposer interface: context from observed target steps
(written into the target's KV blocks), rows grouped by their number of drafts, greedy and
sampled drafts, and loud errors when the engine skipped a step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dflash_helpers import StandInTarget, drafter_config, write_drafter

from deltaserve.cache.planner import CachePlan
from deltaserve.spec.dflash.config import DFlashConfigError
from deltaserve.spec.dflash.proposer import DFlashProposer
from deltaserve.spec.dflash.reference import DenseDrafter
from deltaserve.spec.proposer import ComputedRow, TargetStep

KV_BLOCK = 4
CONFIG = SimpleNamespace(
    model=SimpleNamespace(dtype=torch.float32, device=torch.device("cpu")),
    cache=SimpleNamespace(block_size=KV_BLOCK, state_dtype=torch.float32),
)


def _proposer(path, k: int = 5, **options) -> DFlashProposer:
    spec = SimpleNamespace(model=str(path), num_speculative_tokens=k, options=options)
    proposer = DFlashProposer(spec, CONFIG)
    specs = proposer.layer_specs()  # before bind: from the config
    proposer.bind(StandInTarget())
    assert specs == proposer.drafter.layer_specs()
    proposer.allocate(CachePlan({"paged": 32}, {"paged": 1}), CONFIG)
    return proposer


def _seq(seq_id: int, tokens: list[int], blocks: list[int], temperature: float = 0.0):
    return SimpleNamespace(
        seq_id=seq_id,
        token_ids=list(tokens),
        block_ids=blocks,
        params=SimpleNamespace(temperature=temperature),
        generator=None,
    )


def test_observe_then_propose_matches_the_reference(tmp_path):
    weights = write_drafter(tmp_path / "d", drafter_config())
    proposer = _proposer(tmp_path / "d")
    target = StandInTarget()
    cfg = proposer.drafter_config
    gen = torch.Generator().manual_seed(0)
    seqs = [_seq(1, range(3, 10), [5, 9, 2]), _seq(2, range(20, 23), [7, 1])]
    refs = [
        DenseDrafter(weights, cfg, target.model.embed_tokens.weight, target.lm_head_weight)
        for _ in seqs
    ]
    # a prefill step of both prompts (all but the last token, which was just sampled)
    n = [len(s.token_ids) - 1 for s in seqs]
    taps = {i: torch.randn(sum(n), 32, generator=gen) for i in cfg.target_layer_ids}
    rows = [
        ComputedRow(seqs[0], 0, n[0], range(0, n[0])),
        ComputedRow(seqs[1], 0, n[1], range(n[0], n[0] + n[1])),
    ]
    proposer.observe(TargetStep(rows, taps))
    for ref, row in zip(refs, rows):
        ref.add_context(
            torch.stack(
                [
                    taps[i][row.hidden_rows.start : row.hidden_rows.stop]
                    for i in cfg.target_layer_ids
                ],
                dim=1,
            )
        )
    drafts = proposer.propose(seqs, [5, 3])  # two groups: k = 5 and k = 3
    assert [len(d.token_ids) for d in drafts] == [5, 3]
    for d, seq, ref, k in zip(drafts, seqs, refs, (5, 3)):
        expect = ref.draft_logits(seq.token_ids[-1], k).argmax(-1).tolist()
        assert d.token_ids == expect and d.probs is None

    # a verify step of seq 0 kept 1 + 2 tokens: rows 1..3 of a 6-row step
    taps = {i: torch.randn(6, 32, generator=gen) for i in cfg.target_layer_ids}
    proposer.observe(TargetStep([ComputedRow(seqs[0], n[0], 3, range(1, 4))], taps))
    refs[0].add_context(torch.stack([taps[i][1:4] for i in cfg.target_layer_ids], dim=1))
    seqs[0].token_ids += [40, 41, 42]
    (d,) = proposer.propose(seqs[:1], [9])  # capped at block_size - 1 = 5
    assert d.token_ids == refs[0].draft_logits(42, 5).argmax(-1).tolist()


def test_sampled_drafts_carry_probabilities(tmp_path):
    write_drafter(tmp_path / "d", drafter_config())
    proposer = _proposer(tmp_path / "d", draft_seed=3)
    seq = _seq(1, [4, 5, 6, 7], [3, 4], temperature=0.8)
    taps = {i: torch.randn(3, 32) for i in proposer.tap_layer_ids}
    proposer.observe(TargetStep([ComputedRow(seq, 0, 3, range(3))], taps))
    (d,) = proposer.propose([seq], [4])
    assert len(d.token_ids) == 4 and d.probs.shape == (4, 64)
    torch.testing.assert_close(d.probs.sum(-1), torch.ones(4))
    assert all(d.probs[i, t] > 0 for i, t in enumerate(d.token_ids))


def test_missing_context_and_bad_k_are_loud(tmp_path):
    write_drafter(tmp_path / "d", drafter_config())
    proposer = _proposer(tmp_path / "d")
    seq = _seq(1, [4, 5, 6, 7], [3, 4])
    with pytest.raises(RuntimeError, match="holds context for 0 positions"):
        proposer.propose([seq], [3])
    taps = {i: torch.randn(3, 32) for i in proposer.tap_layer_ids}
    proposer.observe(TargetStep([ComputedRow(seq, 0, 3, range(3))], taps))
    proposer.propose([seq], [3])
    proposer.release(seq)  # forgotten: drafting again needs the context again
    with pytest.raises(RuntimeError, match="holds context for 0 positions"):
        proposer.propose([seq], [3])
    with pytest.raises(DFlashConfigError, match="num_speculative_tokens 6"):
        DFlashProposer(
            SimpleNamespace(model=str(tmp_path / "d"), num_speculative_tokens=6, options={}), CONFIG
        )


def test_bind_sizes_the_drafter_like_the_targets_paged_pool(tmp_path):
    """Bound to a target whose caches are allocated (a ModelInstance), the drafter's K / V get
    the target paged pool's block count, so the target's block ids index them."""
    write_drafter(tmp_path / "d", drafter_config())
    model = StandInTarget()
    instance = SimpleNamespace(
        model=model,
        kernels=None,
        caches=[{"ssm_state": torch.zeros(3, 1)}, {"k_cache": torch.zeros(11, 4, 2, 8)}],
    )
    spec = SimpleNamespace(model=str(tmp_path / "d"), num_speculative_tokens=5, options={})
    proposer = DFlashProposer(spec, CONFIG)
    proposer.bind(instance)
    assert [c["k_cache"].shape for c in proposer.drafter.caches] == [(11, KV_BLOCK, 2, 8)] * 3
