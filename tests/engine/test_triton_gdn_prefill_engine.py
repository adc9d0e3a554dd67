"""The engine with the one-launch Triton GDN prefill (`gdn_prefill_backend="triton"`) on a tiny
hybrid model (GVA 2, K=16 != V=24): greedy tokens equal the torch prefill's and logprobs agree
within 1e-4 (float32), for a batch of mixed prompt lengths (its chunked kernel past 64 tokens,
the token-by-token one below), then for a prefix-cache hit (the
prefill continues from a restored state snapshot). On CPU through Triton's interpreter (the
backend's "no CUDA device" check lifted for the test, as the Triton MoE parity test does); on
the GPU with `pytest -m gpu`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
for _d in (_TESTS_DIR, _TESTS_DIR / "engine"):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

from hf_models import SPECS_BY_NAME, build_model  # noqa: E402
from kernel_helpers import lift_backend_check, requires_triton  # noqa: E402
from test_hybrid_prefix_cache import HYBRID, assert_same, counters, make_llm, run  # noqa: E402
from test_invariants import random_prompt  # noqa: E402

pytestmark = requires_triton

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            torch.cuda.is_available(), reason="Triton's interpreter is on only without a GPU"
        ),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture
def triton_prefill_anywhere(monkeypatch):
    """The `gdn_prefill` family with the Triton backend's check lifted (the interpreter runs
    it on CPU)."""
    lift_backend_check(monkeypatch, "gdn_prefill")


@pytest.mark.parametrize("device", DEVICES)
def test_triton_prefill_engine_matches_torch(device, tmp_path, triton_prefill_anywhere):
    model_dir, oracle = build_model(SPECS_BY_NAME[HYBRID], tmp_path / HYBRID)
    vocab = oracle.config.get_text_config().vocab_size
    ref = make_llm(
        model_dir, enable_prefix_caching=False, gdn_prefill_backend="torch", device=device
    )
    llm = make_llm(model_dir, gdn_prefill_backend="triton", device=device)
    assert llm.llm_engine.runner.instance.backends["gdn_prefill"].name == "triton"
    assert ref.llm_engine.runner.instance.backends["gdn_prefill"].name == "torch"

    prompts = [random_prompt(n, vocab, seed=300 + n) for n in (90, 37, 6)]
    want = [run(ref, [p])[0] for p in prompts]
    # one batch: rows of 90, 37 and 6 tokens (past one 64-token chunk: the chunked kernel)
    for i, got in enumerate(run(llm, prompts)):
        assert_same(got, want[i], f"mixed batch [{i}]")
    # rows within one chunk: the token-by-token kernel
    for i, got in enumerate(run(llm, prompts[1:]), start=1):
        assert_same(got, want[i], f"short batch [{i}]")
    # the first prompt again: a prefix-cache hit continues from its snapshot
    for got in run(llm, prompts[:1]):
        assert_same(got, want[0], "prefix-cache hit")
    # the 37-token prompt of the short batch (the 6-token one has no full block), then this
    assert counters(llm)["prefix_cache_hits"] == 2
