"""Shared by the speculative decode-graph tests (test_spec_graphs.py on CPU with emulated graphs,
test_spec_graphs_gpu.py with real ones): the prompts, a tiny DFlash drafter for a target, and
one comparison of a run with decode graphs against an eager run and the plain output."""

from __future__ import annotations

from pathlib import Path

import torch
from dflash_helpers import drafter_config, write_drafter

from deltaserve import SamplingParams

K = 4
TAPS = (1, 3)  # target layers the tap-reading proposers read (the hybrid targets have 4)
PROMPTS = [
    [5, 17, 3, 44, 9, 12, 31],
    [11, 4, 9, 33, 21, 6, 7, 19, 28, 40, 3],
    [8, 8, 21, 30, 2],
]
LONG = [(7 * i) % 90 + 3 for i in range(37)]
MAX_TOKENS = 40


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm, prompts, max_tokens) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [greedy(n) for n in max_tokens],
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def stub_spec(method: str, prompts, want, **extra) -> dict:
    """A stub proposer (tests/spec/stub_proposers.py) that reads the taps of TAPS."""
    return {
        "method": method,
        "num_speculative_tokens": K,
        "continuations": [(tuple(p), w) for p, w in zip(prompts, want, strict=True)],
        "tap_layer_ids": list(TAPS),
        **extra,
    }


def dflash_spec(path: Path, hidden: int, vocab: int, target_layers: int) -> dict:
    """A tiny random DFlash drafter (z-lab layout, block 6) written to `path` for a target of
    that shape, tapping TAPS."""
    raw = drafter_config(
        hidden_size=hidden,
        vocab_size=vocab,
        num_target_layers=target_layers,
        dflash_config={"block_size": 6, "mask_token_id": vocab - 1, "target_layer_ids": [*TAPS]},
    )
    write_drafter(path, raw)
    return {"method": "dflash", "model": str(path), "num_speculative_tokens": K}


def replays(llm, q: int) -> int:
    """How many target steps of rows of q tokens replayed a decode graph."""
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None
    return sum(n for (_, gq), n in graphs.replays.items() if gq == q)


def assert_no_leak(llm) -> None:
    usage = llm.llm_engine.cache_usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0, usage


def assert_same_taps(graphed: dict, eager: dict, tol: float) -> None:
    """The taps a stub proposer saw: the same kept positions, the same hidden states."""
    assert graphed.keys() == eager.keys()
    for key, value in eager.items():
        torch.testing.assert_close(graphed[key], value, rtol=tol, atol=tol, msg=str(key))


def compare_graphs_with_eager(
    graphed, eager, prompts, max_tokens, want, taps_tol=1e-5, same_drafts=True
) -> None:
    """Both engines give `want`; the graph run replayed verify graphs (and, with a DFlash
    drafter, its block-forward graphs), a tap-reading stub saw the same taps, and with
    `same_drafts` both drafted and accepted alike (a random drafter's near-ties may flip
    between a padded graph batch and an eager one on the GPU; its output may not change)."""
    assert graphed.llm_engine.runner.graphs.query_lens == (1, 1 + K)
    assert eager.llm_engine.runner.graphs is None
    assert generate(graphed, prompts, max_tokens) == want
    assert generate(eager, prompts, max_tokens) == want
    assert replays(graphed, 1 + K) > 0  # verify steps with taps ran in graphs
    stats = [llm.llm_engine.spec.stats for llm in (graphed, eager)]
    assert stats[0].num_verify_rows > 0 and stats[1].num_verify_rows > 0
    if same_drafts:
        assert stats[0].num_verify_rows == stats[1].num_verify_rows
        assert stats[0].drafted == stats[1].drafted and stats[0].accepted == stats[1].accepted
    proposers = [llm.llm_engine.spec.proposer for llm in (graphed, eager)]
    if hasattr(proposers[0], "seen"):
        assert_same_taps(proposers[0].seen, proposers[1].seen, taps_tol)
    drafter_graphs = getattr(proposers[0], "graphs", None)
    if drafter_graphs is not None:
        assert sum(drafter_graphs.replays.values()) > 0
    assert_no_leak(graphed)
    assert_no_leak(eager)
