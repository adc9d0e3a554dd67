"""Speculative decoding through the decode-graph path (DELTASERVE_EMULATE_CUDA_GRAPHS=1: the
buckets, static buffers and padding rows of CUDA graphs, run eagerly on CPU) with proposers that
read the target's hidden states, as DFlash does: verify steps (rows of 1 + k tokens) and plain
decode steps replay graphs that also write the tapped layers' outputs, and the output equals
the eager run's and decoding without speculation, token for token.

- stub proposers (oracle, anti-oracle, truncated oracle) declaring tap layers: the taps the
  graph run hands them equal the eager run's at every kept position;
- the same beside chunked prefill and preemption, and after an abort;
- a real tiny DFlash drafter (random weights, z-lab layout): its greedy block forward replays
  the drafter's graphs too.

Every test asserts that the graph path was taken (replay counters), so a verify step that went
eager again fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
for extra in (_TESTS_DIR, _TESTS_DIR / "spec"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import stub_proposers  # noqa: E402,F401  (registers the stub methods)
from dflash_helpers import drafter_config, write_drafter  # noqa: E402
from hf_models import SPECS_BY_NAME, build_model  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402

HYBRID = "qwen3_5_r2_g3"  # 4 layers: GDN, attention, GDN, GDN
K = 4
TAPS = (1, 3)
PROMPTS = [
    [5, 17, 3, 44, 9, 12, 31],
    [11, 4, 9, 33, 21, 6, 7, 19, 28, 40, 3],
    [8, 8, 21, 30, 2],
]
LONG = [(7 * i) % 90 + 3 for i in range(37)]
MAX_TOKENS = 40


def make_llm(model_dir, spec=None, **kw):
    args = dict(
        dtype="float32",
        device="cpu",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        block_size=4,  # drafts cross block edges
        skip_tokenizer_init=True,
        seed=0,
        speculative_config=spec,
    )
    args.update(kw)
    return LLM(str(model_dir), **args)


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm, prompts, max_tokens):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [greedy(n) for n in max_tokens],
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(model dir, {prompt: greedy output of MAX_TOKENS tokens without speculation})."""
    path, _ = build_model(SPECS_BY_NAME[HYBRID], tmp_path_factory.mktemp(HYBRID), load_oracle=False)
    prompts = PROMPTS + [LONG]
    outs = generate(make_llm(path), prompts, [MAX_TOKENS] * len(prompts))
    return path, {tuple(p): o for p, o in zip(prompts, outs, strict=True)}


@pytest.fixture
def emulated(monkeypatch):
    """Engines built in the test take the decode-graph path on CPU."""
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")


def spec_config(method, prompts, want, **extra):
    return {
        "method": method,
        "num_speculative_tokens": K,
        "continuations": [(tuple(p), w) for p, w in zip(prompts, want, strict=True)],
        "tap_layer_ids": list(TAPS),
        **extra,
    }


def replays(llm, q: int) -> int:
    """How many target steps of rows of q tokens replayed a decode graph."""
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and graphs.emulate
    return sum(n for (_, gq), n in graphs.replays.items() if gq == q)


def assert_no_leak(llm):
    usage = llm.llm_engine.cache_usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0, usage


def assert_same_taps(graphed: dict, eager: dict) -> None:
    """The taps a proposer saw: the same kept positions, the same hidden states."""
    assert graphed.keys() == eager.keys()
    for key, value in eager.items():
        torch.testing.assert_close(graphed[key], value, rtol=1e-5, atol=1e-5, msg=str(key))


@pytest.mark.parametrize(
    "method,extra",
    [("oracle", {}), ("anti_oracle", {}), ("truncated_oracle", {"j": 2})],
)
def test_tap_reading_stubs_in_graphs_equal_eager_and_plain(hybrid, emulated, method, extra):
    path, ref = hybrid
    max_tokens = [23, 30, 17]
    want = [ref[tuple(p)][:n] for p, n in zip(PROMPTS, max_tokens, strict=True)]
    spec = spec_config(method, PROMPTS, want, **extra)
    graphed = make_llm(path, spec)
    eager = make_llm(path, spec, enforce_eager=True)
    assert eager.llm_engine.runner.graphs is None
    assert graphed.llm_engine.runner.graphs.query_lens == (1, 1 + K)
    assert generate(graphed, PROMPTS, max_tokens) == want
    assert generate(eager, PROMPTS, max_tokens) == want
    assert replays(graphed, 1 + K) > 0  # verify steps with taps ran in graphs
    if method == "anti_oracle":  # the last row's last token: a plain decode step, in a graph
        assert replays(graphed, 1) > 0
    stats = [llm.llm_engine.spec.stats for llm in (graphed, eager)]
    assert stats[0].accepted == stats[1].accepted and stats[0].drafted == stats[1].drafted
    assert_same_taps(graphed.llm_engine.spec.proposer.seen, eager.llm_engine.spec.proposer.seen)
    assert_no_leak(graphed)


def test_chunked_prefill_preemption_and_abort_in_graphs(hybrid, emulated):
    """A small budget chunks prompts beside verify rows (those steps run eagerly), a small KV
    cache preempts sequences that carry drafts, an abort drops one mid-generation; the graph
    steps between them keep the output and the taps of the eager run."""
    path, ref = hybrid
    prompts = PROMPTS + [LONG]
    want = [ref[tuple(p)] for p in prompts]
    spec = spec_config("truncated_oracle", prompts, want, j=3)
    small = dict(max_num_batched_tokens=16, num_gpu_blocks_override=30, max_model_len=96)
    graphed = make_llm(path, spec, **small)
    eager = make_llm(path, spec, enforce_eager=True, **small)
    for llm in (graphed, eager):
        assert generate(llm, prompts, [MAX_TOKENS] * 4) == want
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert_no_leak(llm)
    assert replays(graphed, 1 + K) > 0
    assert_same_taps(graphed.llm_engine.spec.proposer.seen, eager.llm_engine.spec.proposer.seen)

    engine = graphed.llm_engine
    before = replays(graphed, 1 + K)
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(f"a{i}", {"prompt_token_ids": p}, greedy(30))
    for _ in range(4):
        engine.step()
    engine.abort_request("a0")
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert list(final.outputs[0].token_ids) == ref[tuple(PROMPTS[1])][:30]
    assert replays(graphed, 1 + K) > before
    assert_no_leak(graphed)


def test_dflash_drafter_in_graphs_equals_eager_and_plain(hybrid, emulated, tmp_path):
    """A tiny random DFlash drafter (z-lab layout) on the hybrid target: verify and decode
    steps replay the target's graphs with the taps, the greedy block forward the drafter's."""
    path, ref = hybrid
    raw = drafter_config(
        hidden_size=48,
        vocab_size=256,
        num_target_layers=4,
        dflash_config={"block_size": 6, "mask_token_id": 255, "target_layer_ids": list(TAPS)},
    )
    write_drafter(tmp_path / "drafter", raw)
    spec = {"method": "dflash", "model": str(tmp_path / "drafter"), "num_speculative_tokens": K}
    prompts = PROMPTS + [LONG]
    max_tokens = [23, 30, 17, 40]
    want = [ref[tuple(p)][:n] for p, n in zip(prompts, max_tokens, strict=True)]
    graphed = make_llm(path, spec)
    eager = make_llm(path, spec, enforce_eager=True)
    assert generate(graphed, prompts, max_tokens) == want
    assert generate(eager, prompts, max_tokens) == want
    assert replays(graphed, 1 + K) > 0
    drafter_graphs = graphed.llm_engine.spec.proposer.graphs
    assert drafter_graphs is not None and drafter_graphs.emulate
    assert sum(drafter_graphs.replays.values()) > 0
    stats = [llm.llm_engine.spec.stats for llm in (graphed, eager)]
    assert stats[0].num_verify_rows == stats[1].num_verify_rows > 0
    assert stats[0].drafted == stats[1].drafted
    assert_no_leak(graphed)
