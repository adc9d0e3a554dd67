"""The tiny MoE parity models run with the Triton `moe` backend (on CPU: Triton's interpreter,
the capability check's "no CUDA device" lifted for the test) give HF's prefill logprobs and HF's
greedy tokens: a Qwen3-Next model without renormalisation (norm_topk_prob false, sparse step 2)
on CPU; on the GPU (`pytest -m gpu`, float32, no lifting needed) that one and a Qwen3.5-MoE model
in the fused layout (12 experts, top-4). Prefills of 37 and 130 tokens
take the sorted path, decode steps the decode path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import QWEN3_5_MOE_SPECS, QWEN3_NEXT_SPECS, build_model  # noqa: E402
from kernel_helpers import lift_backend_check, requires_triton  # noqa: E402
from moe_parity import (  # noqa: E402
    LOGPROB_ATOL,
    hf_greedy,
    make_llm,
    prefill_max_diff,
    random_prompt,
    vocab_of,
)

from deltaserve import SamplingParams  # noqa: E402

pytestmark = requires_triton

SPECS = [QWEN3_5_MOE_SPECS[1], QWEN3_NEXT_SPECS[1]]
# NOTE: the interpreter makes a model run slow: one model on CPU, both on the GPU
CASES = [
    pytest.param(
        QWEN3_NEXT_SPECS[1],
        "cpu",
        id="cpu-" + QWEN3_NEXT_SPECS[1].name,
        marks=pytest.mark.skipif(
            torch.cuda.is_available(), reason="Triton's interpreter is on only without a GPU"
        ),
    ),
    *[pytest.param(s, "cuda", id="cuda-" + s.name, marks=pytest.mark.gpu) for s in SPECS],
]


@pytest.fixture
def triton_moe_anywhere(monkeypatch):
    """The `moe` family with the Triton backend's check lifted (the interpreter runs on CPU)."""
    lift_backend_check(monkeypatch, "moe")


@pytest.mark.parametrize("spec, device", CASES)
def test_triton_moe_matches_hf(spec, device, tmp_path, triton_moe_anywhere):
    """float32 (IEEE dots on the GPU): prefill logprobs within 1e-4 of HF's, then 24 greedy
    tokens of a 130-token and a 6-token prompt in one batch equal HF's."""
    model_dir, oracle = build_model(spec, tmp_path / spec.name)
    oracle.set_experts_implementation("eager")
    oracle.generation_config.eos_token_id = None
    # fla's chunked GDN prefill (picked on the GPU when installed) rounds float32 through TF32:
    # the torch prefill keeps the comparison about the moe backend
    llm = make_llm(model_dir, moe_backend="triton", gdn_prefill_backend="torch", device=device)
    assert llm.llm_engine.runner.instance.backends["moe"].name == "triton"
    diff, _, _ = prefill_max_diff(oracle, llm)
    assert diff < LOGPROB_ATOL, f"{spec.name}: max |diff| {diff:.3e}"
    prompts = [random_prompt(n, vocab_of(oracle), seed=200 + n) for n in (130, 6)]
    expected = [hf_greedy(oracle, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=len(expected[0]), ignore_eos=True)
    with torch.no_grad():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
