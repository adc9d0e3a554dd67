"""Qwen3-Next: parity with HF transformers' own modeling code (modeling_qwen3_next) on tiny
random checkpoints (float32, CPU).

The variants (tests/hf_models.py, QWEN3_NEXT_SPECS): GDN value / key head ratios 2 and 3 with
K != V (both K > V and K < V); 10 experts top-3 (norm_topk_prob true), 12 experts top-4 and 10
experts top-4 (norm_topk_prob false); decoder_sparse_step 2 (dense layers 0 and 2) and
mlp_only_layers [0, 2]; per-expert and fused expert tensors; layer_types given and derived from
full_attention_interval. The GDN in_proj_qkvz / in_proj_ba rows are interleaved per key head:
a contiguous split gives wrong logits (test_contiguous_in_proj_split_is_caught). Routers are
peaky (gain 4) and every expert is used (checked on the oracle).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parents[1]
if str(_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(_TESTS_DIR))

from hf_models import QWEN3_NEXT_SPECS, build_model, tensor_names  # noqa: E402
from moe_parity import (  # noqa: E402
    LOGPROB_ATOL,
    PREFILL_LEN,
    check_greedy_matches_hf,
    make_llm,
    oracle_routes,
    prefill_max_diff,
)


@pytest.fixture(scope="module", params=QWEN3_NEXT_SPECS, ids=[s.name for s in QWEN3_NEXT_SPECS])
def variant(request, tmp_path_factory):
    spec = request.param
    model_dir, oracle = build_model(spec, tmp_path_factory.mktemp(spec.name))
    oracle.set_experts_implementation("eager")
    oracle.generation_config.eos_token_id = None
    yield spec, model_dir, oracle, make_llm(model_dir)


def test_checkpoint_layout_and_routing(variant):
    """The checkpoint has the layout the variant claims, and on the parity prompt every layer's
    router uses every expert with many distinct top-k sets."""
    spec, model_dir, oracle, _ = variant
    names = tensor_names(model_dir)
    fused = [n for n in names if n.endswith("mlp.experts.gate_up_proj")]
    per_expert = [n for n in names if re.search(r"mlp\.experts\.\d+\.gate_proj\.weight$", n)]
    text = oracle.config.get_text_config()
    sparse = sum(
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in oracle.model.layers
    )
    if spec.fused_experts:
        assert len(fused) == sparse and not per_expert
    else:
        assert not fused and len(per_expert) == sparse * text.num_experts
    assert any(n.endswith("linear_attn.in_proj_qkvz.weight") for n in names)
    routes = oracle_routes(oracle)
    assert len(routes) == sparse
    for ids in routes:
        assert ids.unique().numel() == text.num_experts
        assert len({tuple(sorted(r)) for r in ids.tolist()}) >= PREFILL_LEN // 2


@torch.no_grad()
def test_prefill_logprobs_match_hf(variant):
    spec, _, oracle, llm = variant
    diff, ref, tokens = prefill_max_diff(oracle, llm)
    assert diff < LOGPROB_ATOL, f"{spec.name}: max |diff| {diff:.3e}"
    assert tokens == [int(ref[-1].argmax())]


def test_greedy_matches_hf_generate(variant):
    spec, model_dir, oracle, llm = variant
    check_greedy_matches_hf(spec.name, model_dir, oracle, llm)


@torch.no_grad()
def test_contiguous_in_proj_split_is_caught(variant, monkeypatch):
    """Loading in_proj_qkvz / in_proj_ba by contiguous slicing (the classic bug) is far off."""
    from deltaserve.layers.gdn import InterleavedGDNInProj

    spec, model_dir, oracle, _ = variant

    def contiguous(self, shard, tensor):
        hk, hv, k, v = self.heads
        if shard == "in_proj_qkvz":
            qkv, z = tensor.split([2 * hk * k + hv * v, hv * v])
            return {"in_proj_qkv": qkv, "in_proj_z": z}
        b, a = tensor.split([hv, hv])
        return {"in_proj_b": b, "in_proj_a": a}

    monkeypatch.setattr(InterleavedGDNInProj, "deinterleave", contiguous)
    diff, _, _ = prefill_max_diff(oracle, make_llm(model_dir))
    assert diff > 1e-2, f"{spec.name}: contiguous slicing went unseen (max |diff| {diff:.3e})"


def test_registry_knows_qwen3_next():
    from deltaserve.models.registry import architecture_for_model_type, get_model_class

    assert architecture_for_model_type("qwen3_next") == "Qwen3NextForCausalLM"
    assert get_model_class("Qwen3NextForCausalLM").__name__ == "Qwen3NextForCausalLM"
