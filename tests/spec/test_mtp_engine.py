"""Speculative method "mtp" through the engine with the real MTP proposer (random `mtp.*` heads
written into tiny checkpoints, no stubs): greedy output equals decoding without speculation for
a batch of mixed-length prompts, beside chunked prefill and preemption, on a hybrid Qwen3.5
target and a Qwen3-Next MoE target; the decode-graph path (emulated on CPU) replays verify
graphs that keep the final-hidden tap; start-up refuses a target without an MTP head, naming
why. (A random head is rarely right: tests/spec/test_mtp_trained.py covers accepted drafts.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
for extra in (_TESTS_DIR, _TESTS_DIR / "spec"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402
from mtp_helpers import add_mtp_head  # noqa: E402
from spec_graph_runs import LONG, PROMPTS, assert_no_leak, generate, replays  # noqa: E402

from deltaserve import LLM  # noqa: E402
from deltaserve.spec.mtp.checks import MTPConfigError  # noqa: E402
from deltaserve.spec.proposer import FINAL_HIDDEN_TAP  # noqa: E402

MAX_TOKENS = 24
ALL = PROMPTS + [LONG]


def make_llm(path, k=None, **kw):
    args = dict(
        dtype="float32",
        device="cpu",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        block_size=4,  # chains and verify rows cross block edges
        skip_tokenizer_init=True,
        seed=0,
    )
    if k is not None:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    args.update(kw)
    return LLM(str(path), **args)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(dir, plain greedy outputs of ALL) for the tiny hybrid Qwen3.5 target with a random MTP
    head."""
    name = "qwen3_5_r2_g3"
    path, _ = build_model(SPECS_BY_NAME[name], tmp_path_factory.mktemp(name), load_oracle=False)
    add_mtp_head(path, seed=2)
    return path, generate(make_llm(path), ALL, [MAX_TOKENS] * len(ALL))


def test_moe_target_greedy_output_equals_plain(tmp_path):
    """Qwen3-Next (MoE in every layer, the head's too; per-expert tensors): few short prompts,
    its torch MoE reference is slow on CPU."""
    name = "qwen3_next_e10k3_r2"
    path, _ = build_model(SPECS_BY_NAME[name], tmp_path / name, load_oracle=False)
    add_mtp_head(path, seed=4)
    prompts, n = PROMPTS[:2], [10, 10]
    want = generate(make_llm(path), prompts, n)
    llm = make_llm(path, 2)
    assert generate(llm, prompts, n) == want
    assert llm.llm_engine.spec.stats.num_verify_rows > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_equals_plain(target, k):
    path, want = target
    llm = make_llm(path, k)
    assert generate(llm, ALL, [MAX_TOKENS] * len(ALL)) == want
    engine = llm.llm_engine
    assert engine.spec.proposer.tap_layer_ids == (FINAL_HIDDEN_TAP,)
    assert engine.spec.stats.num_verify_rows > 0
    assert_no_leak(llm)


def test_chunked_prefill_and_preemption(target):
    """A small budget chunks the long prompt beside verify rows (the head's KV is inserted
    chunk by chunk, the last position of a chunk waiting for the next one), and a small KV
    cache preempts sequences (recomputed and observed again)."""
    path, want = target
    llm = make_llm(path, 2, max_num_batched_tokens=16, num_gpu_blocks_override=30, max_model_len=96)
    assert generate(llm, ALL, [MAX_TOKENS] * len(ALL)) == want
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.spec.stats.num_verify_rows > 0
    assert_no_leak(llm)


def spy_taps(llm) -> dict:
    """Record, per (request, first position) of every kept row the proposer observes, the
    final-hidden tap rows it was handed."""
    proposer = llm.llm_engine.spec.proposer
    seen: dict = {}
    observe = proposer.observe

    def spy(step):
        taps = step.taps[FINAL_HIDDEN_TAP]
        for row in step.rows:
            rows = list(row.hidden_rows)
            seen[(row.seq.request_id, row.first_position)] = taps[rows].clone()
        observe(step)

    proposer.observe = spy
    return seen


def test_verify_steps_replay_graphs_with_the_final_hidden_tap(target, monkeypatch):
    """Emulated CUDA graphs: verify steps (q = 1 + k) replay graphs that write the final-normed
    hidden state into the static taps buffer; the MTP head drafts from it: the output, every
    draft and every tap row equal the eager engine's."""
    path, want = target
    k = 3
    eager = make_llm(path, k, enforce_eager=True)
    eager_taps = spy_taps(eager)
    assert generate(eager, ALL, [MAX_TOKENS] * len(ALL)) == want
    monkeypatch.setenv("DELTASERVE_EMULATE_CUDA_GRAPHS", "1")
    graphed = make_llm(path, k)
    graph_taps = spy_taps(graphed)
    runner = graphed.llm_engine.runner
    assert runner.graphs.query_lens == (1, 1 + k)
    assert runner.instance.tap_layers == (FINAL_HIDDEN_TAP,)
    assert generate(graphed, ALL, [MAX_TOKENS] * len(ALL)) == want
    assert replays(graphed, 1 + k) > 0
    chain = graphed.llm_engine.spec.proposer.graphs
    assert chain is not None and sum(chain.replays.values()) > 0  # the head's chain graphs
    assert eager.llm_engine.spec.proposer.graphs is None
    stats = [llm.llm_engine.spec.stats for llm in (graphed, eager)]
    assert stats[0].drafted == stats[1].drafted and stats[0].accepted == stats[1].accepted
    assert graph_taps.keys() == eager_taps.keys()
    for key, value in eager_taps.items():
        torch.testing.assert_close(graph_taps[key], value, rtol=1e-5, atol=1e-5, msg=str(key))
    assert_no_leak(graphed)


def test_start_up_refuses_targets_without_a_head(tmp_path):
    qwen3, _ = build_model(SPECS_BY_NAME["qwen3_g1"], tmp_path / "qwen3", load_oracle=False)
    with pytest.raises(MTPConfigError, match="Qwen3ForCausalLM has no MTP head"):
        make_llm(qwen3, 2)
    bare, _ = build_model(SPECS_BY_NAME["qwen3_5_r2_g3"], tmp_path / "bare", load_oracle=False)
    with pytest.raises(MTPConfigError, match=r"has no mtp\.\* tensors"):
        make_llm(bare, 2)
    make_llm(bare)  # without the method, nothing is asked of the checkpoint


def test_prefix_cache_hits(target):
    """The same prompts again on one engine hit the prefix cache: the head's first observed
    position is past 0 (the hit blocks' K / V are the first run's); the output is unchanged."""
    path, want = target
    llm = make_llm(path, 2)
    assert generate(llm, ALL, [MAX_TOKENS] * len(ALL)) == want
    hits_before = llm.llm_engine.prefix_cache_stats()["prefix_cache_hits"]
    assert generate(llm, ALL, [MAX_TOKENS] * len(ALL)) == want
    assert llm.llm_engine.prefix_cache_stats()["prefix_cache_hits"] > hits_before
    assert_no_leak(llm)
