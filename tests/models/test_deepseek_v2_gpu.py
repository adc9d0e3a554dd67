"""DeepSeek-V2 with the fast backends: the tiny parity checkpoints with the Triton `moe`
backend (greedy routing: the op's own, DeepSeek's scaled rule with float32 weights;
group-limited: given, float32 topk_weights from the DeepSeek router; ungated shared experts)
give HF's prefill logprobs and greedy tokens. On CPU: Triton's interpreter (the capability
check lifted), prefill, and for greedy routing 4 batch-1 decode steps; on the GPU (`pytest -m
gpu`, float32, whatever `mla` backend `auto` picks there): prefill and 24 greedy tokens of a
130-token and a 6-token prompt in one batch; the Triton MLA backend against the torch one (on
CPU under the interpreter, and on the GPU), absorbed and with mixed steps expanded. Also on the
GPU: the `deepseek-v2-lite` random preset in bf16 starts, reports its latent cache and generates
finite logprobs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import DEEPSEEK_V2_SPECS, build_model  # noqa: E402
from kernel_helpers import lift_backend_check, requires_triton  # noqa: E402
from moe_parity import (  # noqa: E402
    LOGPROB_ATOL,
    hf_greedy,
    make_llm,
    prefill_max_diff,
    random_prompt,
    record_rows,
    vocab_of,
)

from deltaserve import LLM, SamplingParams  # noqa: E402

CASES = [
    *[
        pytest.param(
            s,
            "cpu",
            id="cpu-" + s.name,
            marks=[
                requires_triton,
                pytest.mark.skipif(
                    torch.cuda.is_available(),
                    reason="Triton's interpreter is on only without a GPU",
                ),
            ],
        )
        for s in DEEPSEEK_V2_SPECS
    ],
    *[
        pytest.param(s, "cuda", id="cuda-" + s.name, marks=[requires_triton, pytest.mark.gpu])
        for s in DEEPSEEK_V2_SPECS
    ],
]


@pytest.fixture
def triton_moe_anywhere(monkeypatch):
    """The `moe` family with the Triton backend's check lifted (the interpreter runs on CPU)."""
    lift_backend_check(monkeypatch, "moe")


@pytest.mark.parametrize("spec, device", CASES)
def test_deepseek_v2_triton_moe_matches_hf(spec, device, tmp_path, triton_moe_anywhere):
    model_dir, oracle = build_model(spec, tmp_path / spec.name)
    oracle.set_experts_implementation("eager")
    oracle.generation_config.eos_token_id = None
    llm = make_llm(model_dir, moe_backend="triton", device=device)
    assert llm.llm_engine.runner.instance.backends["moe"].name == "triton"
    diff, _, _ = prefill_max_diff(oracle, llm)
    assert diff < LOGPROB_ATOL, f"{spec.name}: max |diff| {diff:.3e}"
    if device == "cpu":
        # the interpreter is slow: the decode path is covered on the GPU, save a few batch-1
        # steps (greedy routing: inside the decode gate_up kernel)
        if spec.config["topk_method"] == "greedy":
            prompt = random_prompt(6, vocab_of(oracle), seed=206)
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            out = llm.generate([{"prompt_token_ids": prompt}], params)
            assert list(out[0].outputs[0].token_ids) == hf_greedy(oracle, prompt)[:4]
        return
    prompts = [random_prompt(n, vocab_of(oracle), seed=200 + n) for n in (130, 6)]
    expected = [hf_greedy(oracle, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=len(expected[0]), ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected, spec.name


@pytest.mark.gpu
def test_deepseek_v2_lite_preset_runs_in_bf16(caplog, monkeypatch):
    """The released Lite shape (random bf16 weights) on one GPU: the latent cache is planned
    (576 values per token and layer), and a batch generates finite logprobs."""
    import logging

    # NOTE: without piecewise graphs (tests/engine/test_piecewise_graphs_gpu.py covers MLA and
    # MoE pieces): on a machine without Triton's cache, their capture tunes the MoE kernels at
    # more token counts, which took this test past 7 minutes on an H200
    monkeypatch.setenv("DELTASERVE_PIECEWISE_GRAPH_TOKENS", "0")

    with caplog.at_level(logging.INFO, logger="deltaserve"):
        logging.getLogger("deltaserve").addHandler(caplog.handler)
        try:
            llm = LLM(
                random_model="deepseek-v2-lite",
                dtype="bfloat16",
                max_model_len=2048,
                max_num_seqs=8,
                gpu_memory_utilization=0.85,
                seed=0,
                # NOTE: FlashInfer's MLA JIT-builds for minutes on a machine without its cache;
                # its kernels are checked against the reference in tests/ops/test_mla_triton.py
                mla_backend="triton",
            )
        finally:
            logging.getLogger("deltaserve").removeHandler(caplog.handler)
    caches = llm.llm_engine.runner.instance.caches
    assert caches[0]["latent_cache"].shape[1:] == (16, 576)
    assert any("tokens:" in r.getMessage() for r in caplog.records)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (5, 300, 77)]
    for out in llm.generate(prompts, params):
        assert len(out.outputs[0].token_ids) == 16
        for pos in out.outputs[0].logprobs:
            assert all(torch.isfinite(torch.tensor(lp.logprob)) for lp in pos.values())


@pytest.fixture
def triton_mla_anywhere(monkeypatch):
    """The `mla` family with the Triton backend's check lifted (the interpreter runs on CPU)."""
    lift_backend_check(monkeypatch, "mla")


TRITON_MLA_CASES = [
    pytest.param(
        "cpu",
        marks=[
            requires_triton,
            pytest.mark.skipif(
                torch.cuda.is_available(), reason="Triton's interpreter is on only without a GPU"
            ),
        ],
    ),
    pytest.param("cuda", marks=[requires_triton, pytest.mark.gpu]),
]


@pytest.mark.parametrize("device", TRITON_MLA_CASES)
@pytest.mark.parametrize("expanded_min_query", [None, 8], ids=["absorbed", "expanded-from-8"])
def test_deepseek_v2_through_the_triton_mla_kernels(
    tmp_path, triton_mla_anywhere, monkeypatch, expanded_min_query, device
):
    """The whole model with the Triton MLA backend (latent writer, split decode, ragged
    prefill), float32, under the interpreter on CPU or on the GPU: prefill logprobs within 1e-4
    of HF's, and a batch's greedy tokens and their logprobs (a 5-token prompt decoding beside a
    chunked 40-token one, so steps mix decode and prefill rows) equal to the same engine's with
    the torch MLA reference (itself equal to HF's uncached greedy in
    test_deepseek_v2_parity.py). With the Triton backend's `expanded_min_query` at 8, prefill
    rows of steps with a query of 8 or more run expanded, in mixed steps beside the decode rows
    its split decode attends (`decode_rows`)."""
    from deltaserve.ops.mla.triton_backend import TritonMLABackend

    monkeypatch.setenv("DELTASERVE_MLA_PREFILL", "auto")
    monkeypatch.setattr(TritonMLABackend, "expanded_min_query", expanded_min_query)
    decoded = record_rows(monkeypatch, TritonMLABackend, "decode_rows")
    spec = DEEPSEEK_V2_SPECS[0]
    model_dir, oracle = build_model(spec, tmp_path / spec.name)
    oracle.set_experts_implementation("eager")
    prompts = [random_prompt(n, vocab_of(oracle), seed=300 + n) for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs, logprobs = {}, {}
    for name in ("triton", "torch"):
        llm = make_llm(model_dir, mla_backend=name, max_num_batched_tokens=16, device=device)
        assert llm.llm_engine.runner.instance.backends["mla"].name == name
        if name == "triton":
            diff, _, _ = prefill_max_diff(oracle, llm)
            assert diff < LOGPROB_ATOL, f"max |diff| {diff:.3e}"
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        outs[name] = [list(o.outputs[0].token_ids) for o in got]
        logprobs[name] = [
            [pos[t].logprob for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in got
        ]
    assert outs["triton"] == outs["torch"]
    assert all(len(t) == 6 for t in outs["torch"])
    # the mixed steps' decode rows went through decode_rows only when prefill rows expanded
    assert bool(decoded) == (expanded_min_query is not None)
    # the decode steps' logprobs too (greedy tokens alone can miss a wrong softmax)
    for fast, ref in zip(logprobs["triton"], logprobs["torch"]):
        assert torch.allclose(torch.tensor(fast), torch.tensor(ref), atol=LOGPROB_ATOL, rtol=0)
