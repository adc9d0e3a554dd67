"""Speculative decoding with real CUDA graphs (`pytest -m gpu`): the comparison of
test_spec_graphs.py (graph run = eager run = plain decoding, token for token; verify steps
replayed graphs that keep the tapped layers' outputs, prefill steps piecewise graphs that keep
them too; a tap-reading stub sees the eager run's taps; a tiny DFlash drafter's greedy block
forward replays its own graphs) on a tiny hybrid model whose shapes the Triton kernels serve
(attention head_dim 32, GDN K = V = 32: Triton attention, GDN decode, conv and replay),
float32. The GDN prefill is pinned to the torch reference: fla's chunked prefill rounds float32
through TF32, which can flip a greedy token between the plain and the speculative runs (they
prefill different chunks)."""

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
from hf_models import ModelSpec, _qwen3_5_text_kwargs, build_model  # noqa: E402
from spec_graph_runs import (  # noqa: E402
    LONG,
    MAX_TOKENS,
    PROMPTS,
    compare_graphs_with_eager,
    dflash_spec,
    generate,
    replays,
    stub_spec,
)

from deltaserve import LLM  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# qwen3_5_r2_g3's shapes with V = 32: every GDN backend can be Triton
TRITON_HYBRID = ModelSpec(
    "qwen3_5_triton", "qwen3_5", _qwen3_5_text_kwargs(linear_value_head_dim=32)
)


def make_llm(model_dir, spec=None, **kw):
    args = dict(
        dtype="float32",
        device="cuda",
        max_model_len=256,
        max_num_seqs=4,
        block_size=16,
        skip_tokenizer_init=True,
        seed=0,
        gdn_prefill_backend="torch",
        speculative_config=spec,
        async_scheduling=None if spec is None else False,
    )
    args.update(kw)
    return LLM(str(model_dir), **args)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(model dir, {prompt: greedy output without speculation, graphs on})."""
    path, _ = build_model(TRITON_HYBRID, tmp_path_factory.mktemp("hybrid"), load_oracle=False)
    prompts = PROMPTS + [LONG]
    plain = make_llm(path)
    decisions = plain.llm_engine.runner.backend_decisions
    for op in ("attention", "gdn_decode", "conv1d"):
        assert decisions[op].chosen.name == "triton", decisions[op].describe()
    outs = generate(plain, prompts, [MAX_TOKENS] * len(prompts))
    return path, {tuple(p): o for p, o in zip(prompts, outs, strict=True)}


def _real_graphs(llm) -> None:
    runner = llm.llm_engine.runner
    assert runner.graphs is not None and not runner.graphs.emulate
    assert runner.backend_decisions["gdn_replay"].chosen.name == "triton"


@pytest.mark.parametrize(
    "method,extra",
    [("oracle", {}), ("anti_oracle", {}), ("truncated_oracle", {"j": 2})],
)
def test_gpu_tap_reading_stubs_in_graphs(target, method, extra):
    path, ref = target
    max_tokens = [23, 30, 17]
    want = [ref[tuple(p)][:n] for p, n in zip(PROMPTS, max_tokens, strict=True)]
    spec = stub_spec(method, PROMPTS, want, **extra)
    graphed = make_llm(path, spec)
    _real_graphs(graphed)
    eager = make_llm(path, spec, enforce_eager=True)
    compare_graphs_with_eager(graphed, eager, PROMPTS, max_tokens, want, taps_tol=1e-4)
    # the prefill steps replayed piecewise graphs, which wrote the taps the stub compared
    pieces = graphed.llm_engine.runner.instance.piecewise
    assert pieces is not None and not pieces.emulate and sum(pieces.replays.values()) > 0
    if method == "anti_oracle":
        assert replays(graphed, 1) > 0


def test_gpu_dflash_drafter_in_graphs(target, tmp_path):
    path, ref = target
    spec = dflash_spec(tmp_path / "drafter", hidden=48, vocab=256, target_layers=4)
    prompts = PROMPTS + [LONG]
    max_tokens = [23, 30, 17, 40]
    want = [ref[tuple(p)][:n] for p, n in zip(prompts, max_tokens, strict=True)]
    graphed = make_llm(path, spec)
    _real_graphs(graphed)
    drafter_graphs = graphed.llm_engine.spec.proposer.graphs
    assert drafter_graphs is not None and not drafter_graphs.emulate
    assert len(drafter_graphs.graphs) == len(drafter_graphs.buckets)
    eager = make_llm(path, spec, enforce_eager=True)
    compare_graphs_with_eager(graphed, eager, prompts, max_tokens, want, same_drafts=False)
