"""MTP speculative decoding with real CUDA graphs (`pytest -m gpu`): a tiny hybrid target whose
shapes the Triton kernels serve (as tests/spec/test_spec_graphs_gpu.py: attention head_dim 32,
GDN K = V = 32; GDN prefill pinned to the torch reference, whose float32 does not round through
TF32) with a random `mtp.*` head: greedy output with graphs = eager = plain decoding, token for
token, at k = 1 and 3; verify steps replayed graphs that keep the final-hidden tap; nothing
leaks. And the head trained on CPU (tests/spec/mtp_training.py) on the GPU: acceptance >= 1.8
at k = 2 with graphs, the plain output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
for extra in (_TESTS_DIR, _TESTS_DIR / "spec"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from hf_models import ModelSpec, _qwen3_5_text_kwargs, build_model  # noqa: E402
from mtp_helpers import add_mtp_head  # noqa: E402
from spec_graph_runs import LONG, PROMPTS, assert_no_leak, generate, replays  # noqa: E402

from deltaserve import LLM  # noqa: E402
from deltaserve.spec.proposer import FINAL_HIDDEN_TAP  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TRITON_HYBRID = ModelSpec(
    "qwen3_5_triton", "qwen3_5", _qwen3_5_text_kwargs(linear_value_head_dim=32)
)
ALL = PROMPTS + [LONG]
MAX_TOKENS = 40


def make_llm(path, k=None, **kw):
    args = dict(
        dtype="float32",
        device="cuda",
        max_model_len=256,
        max_num_seqs=4,
        block_size=16,
        skip_tokenizer_init=True,
        seed=0,
        gdn_prefill_backend="torch",
    )
    if k is not None:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
        args["async_scheduling"] = False
    args.update(kw)
    return LLM(str(path), **args)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path, _ = build_model(TRITON_HYBRID, tmp_path_factory.mktemp("hybrid"), load_oracle=False)
    add_mtp_head(path, seed=2)
    plain = make_llm(path)
    decisions = plain.llm_engine.runner.backend_decisions
    for op in ("attention", "gdn_decode", "conv1d"):
        assert decisions[op].chosen.name == "triton", decisions[op].describe()
    return path, generate(plain, ALL, [MAX_TOKENS] * len(ALL))


@pytest.mark.parametrize("k", [1, 3])
def test_gpu_mtp_greedy_in_graphs_equals_plain(target, k):
    path, want = target
    graphed = make_llm(path, k)
    runner = graphed.llm_engine.runner
    assert runner.graphs is not None and not runner.graphs.emulate
    assert runner.graphs.query_lens == (1, 1 + k)
    assert runner.instance.tap_layers == (FINAL_HIDDEN_TAP,)
    assert generate(graphed, ALL, [MAX_TOKENS] * len(ALL)) == want
    assert replays(graphed, 1 + k) > 0  # verify steps with the final-hidden tap in graphs
    chain = graphed.llm_engine.spec.proposer.graphs
    assert chain is not None and not chain.emulate and sum(chain.replays.values()) > 0
    eager = make_llm(path, k, enforce_eager=True)
    assert generate(eager, ALL, [MAX_TOKENS] * len(ALL)) == want
    assert graphed.llm_engine.spec.stats.num_verify_rows > 0
    assert_no_leak(graphed)
    assert_no_leak(eager)


def test_gpu_trained_head_accepts_in_graphs(tmp_path):
    from mtp_training import language, permutations, train_head, train_target

    gen = torch.Generator().manual_seed(0)
    table = permutations()
    hf_target, _ = train_target(tmp_path / "target", gen, table)
    train_head(hf_target, tmp_path / "target", gen, table)
    prompts = language(6, 9, torch.Generator().manual_seed(5), table).tolist()
    want = generate(make_llm(tmp_path / "target"), prompts, [30] * len(prompts))
    llm = make_llm(tmp_path / "target", 2)
    assert generate(llm, prompts, [30] * len(prompts)) == want
    mean = llm.llm_engine.spec.stats.snapshot().mean_acceptance_length
    assert mean >= 1.8, f"mean acceptance length {mean:.2f} on the GPU"
    graphs = llm.llm_engine.runner.graphs
    if graphs is not None:  # the trained target's head_dim 16 may leave graphs off
        assert replays(llm, 3) > 0
