"""Speculative decoding through the decode-graph path (DELTASERVE_EMULATE_CUDA_GRAPHS=1: the
buckets, static buffers and padding rows of CUDA graphs, run eagerly on CPU) with proposers that
read the target's hidden states, as DFlash does: verify steps (rows of 1 + k tokens) and plain
decode steps replay graphs that also write the tapped layers' outputs, prefill steps run from
piecewise graphs that write them too (engine/piecewise_graphs.py), and the output equals the
eager run's and decoding without speculation, token for token.

- stub proposers (oracle, anti-oracle, truncated oracle) declaring tap layers: the taps the
  graph run hands them equal the eager run's at every kept position;
- the same beside chunked prefill and preemption, and after an abort;
- a real tiny DFlash drafter (random weights, z-lab layout): its greedy block forward replays
  the drafter's graphs too.

Every test asserts that the graph path was taken (replay counters), so a verify step that went
eager again fails here. tests/spec/test_spec_graphs_gpu.py runs the comparison with real graphs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parents[1]
for extra in (_TESTS_DIR, _TESTS_DIR / "spec"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import stub_proposers  # noqa: E402,F401  (registers the stub methods)
from hf_models import SPECS_BY_NAME, build_model  # noqa: E402
from spec_graph_runs import (  # noqa: E402
    LONG,
    MAX_TOKENS,
    PROMPTS,
    K,
    assert_no_leak,
    assert_same_taps,
    compare_graphs_with_eager,
    dflash_spec,
    generate,
    greedy,
    replays,
    stub_spec,
)

from deltaserve import LLM  # noqa: E402

HYBRID = "qwen3_5_r2_g3"  # 4 layers: GDN, attention, GDN, GDN


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


@pytest.mark.parametrize(
    "method,extra",
    [("oracle", {}), ("anti_oracle", {}), ("truncated_oracle", {"j": 2})],
)
def test_tap_reading_stubs_in_graphs_equal_eager_and_plain(hybrid, emulated, method, extra):
    path, ref = hybrid
    max_tokens = [23, 30, 17]  # rows end at different steps: buckets with padding rows
    want = [ref[tuple(p)][:n] for p, n in zip(PROMPTS, max_tokens, strict=True)]
    spec = stub_spec(method, PROMPTS, want, **extra)
    graphed = make_llm(path, spec)
    assert graphed.llm_engine.runner.graphs.emulate
    eager = make_llm(path, spec, enforce_eager=True)
    compare_graphs_with_eager(graphed, eager, PROMPTS, max_tokens, want)
    # the prefill steps ran piecewise, their taps written by the pieces (and equal the eager's)
    pieces = graphed.llm_engine.runner.instance.piecewise
    assert pieces is not None and sum(pieces.replays.values()) > 0
    if method == "anti_oracle":  # the last row's last token: a plain decode step, in a graph
        assert replays(graphed, 1) > 0


def test_chunked_prefill_preemption_and_abort_in_graphs(hybrid, emulated):
    """A small budget chunks prompts beside verify rows (those steps run eagerly), a small KV
    cache preempts sequences that carry drafts, an abort drops one mid-generation; the graph
    steps between them keep the output and the taps of the eager run."""
    path, ref = hybrid
    prompts = PROMPTS + [LONG]
    want = [ref[tuple(p)] for p in prompts]
    spec = stub_spec("truncated_oracle", prompts, want, j=3)
    small = dict(max_num_batched_tokens=16, num_gpu_blocks_override=30, max_model_len=96)
    graphed = make_llm(path, spec, **small)
    eager = make_llm(path, spec, enforce_eager=True, **small)
    for llm in (graphed, eager):
        assert generate(llm, prompts, [MAX_TOKENS] * 4) == want
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert_no_leak(llm)
    assert replays(graphed, 1 + K) > 0
    seen = [llm.llm_engine.spec.proposer.seen for llm in (graphed, eager)]
    assert_same_taps(*seen, tol=1e-5)

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
    """A tiny random DFlash drafter on the hybrid target: verify and decode steps replay the
    target's graphs with the taps, the greedy block forward the drafter's."""
    path, ref = hybrid
    spec = dflash_spec(tmp_path / "drafter", hidden=48, vocab=256, target_layers=4)
    prompts = PROMPTS + [LONG]
    max_tokens = [23, 30, 17, 40]
    want = [ref[tuple(p)][:n] for p, n in zip(prompts, max_tokens, strict=True)]
    graphed = make_llm(path, spec)
    eager = make_llm(path, spec, enforce_eager=True)
    assert graphed.llm_engine.spec.proposer.graphs.emulate
    compare_graphs_with_eager(graphed, eager, prompts, max_tokens, want)
