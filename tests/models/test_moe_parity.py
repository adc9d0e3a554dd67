"""Qwen3.5-MoE: parity with HF transformers' own modeling code on tiny random checkpoints
(float32, CPU), both checkpoint layouts, and the load error of a missing expert tensor.

The variants (tests/hf_models.py, QWEN3_5_MOE_SPECS): 10 experts top-3 with GQA group 3 in HF
save_pretrained's per-expert layout; 12 experts top-4 with GQA group 5 and the multimodal
layout, both in the released fused layout. Linear-attention value / key head ratio 2, K != V.
Routers are peaky (gain 4): the routing varies from token to token and every expert is used
(checked on the oracle). The oracle runs HF's eager experts loop (the modeling file's math).
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

from hf_models import QWEN3_5_MOE_SPECS, build_model, remove_tensor, tensor_names  # noqa: E402
from moe_parity import (  # noqa: E402
    LOGPROB_ATOL,
    PREFILL_LEN,
    check_greedy_matches_hf,
    make_llm,
    oracle_routes,
    prefill_max_diff,
)


@pytest.fixture(scope="module", params=QWEN3_5_MOE_SPECS, ids=[s.name for s in QWEN3_5_MOE_SPECS])
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
    if spec.fused_experts:
        assert len(fused) == text.num_hidden_layers and not per_expert
    else:
        assert not fused and len(per_expert) == text.num_hidden_layers * text.num_experts
    routes = oracle_routes(oracle)
    assert len(routes) == text.num_hidden_layers
    for ids in routes:
        assert ids.unique().numel() == text.num_experts
        assert len({tuple(sorted(r)) for r in ids.tolist()}) >= PREFILL_LEN // 2


def test_prefill_logprobs_match_hf(variant):
    spec, _, oracle, llm = variant
    diff, ref, tokens = prefill_max_diff(oracle, llm)
    assert diff < LOGPROB_ATOL, f"{spec.name}: max |diff| {diff:.3e}"
    assert tokens == [int(ref[-1].argmax())]


def test_greedy_matches_hf_generate(variant):
    spec, model_dir, oracle, llm = variant
    check_greedy_matches_hf(spec.name, model_dir, oracle, llm)


@pytest.mark.parametrize(
    "spec_index, tensor",
    [
        (0, "model.layers.2.mlp.experts.7.up_proj.weight"),
        (0, "model.layers.0.mlp.experts.0.down_proj.weight"),
        (1, "model.layers.1.mlp.experts.down_proj"),
    ],
)
def test_missing_expert_tensor_is_named(tmp_path, spec_index, tensor):
    spec = QWEN3_5_MOE_SPECS[spec_index]
    model_dir, _ = build_model(spec, tmp_path / "m", load_oracle=False)
    remove_tensor(model_dir, tensor)
    if spec.fused_experts:  # the fused tensor covers every expert: each is named
        tensor = tensor.replace("experts.down_proj", "experts.0.down_proj.weight")
    with pytest.raises(Exception, match=re.escape(tensor)):
        make_llm(model_dir)


def test_mixed_layouts_fail(tmp_path):
    """A per-expert tensor beside the fused one for the same slot is a duplicate."""
    from hf_models import add_tensor

    spec = QWEN3_5_MOE_SPECS[1]
    model_dir, _ = build_model(spec, tmp_path / "m", load_oracle=False)
    text = spec.config
    extra = "model.layers.0.mlp.experts.3.gate_proj.weight"
    shape = (text["moe_intermediate_size"], text["hidden_size"])
    add_tensor(model_dir, extra, torch.zeros(shape))
    with pytest.raises(Exception, match="appears twice"):
        make_llm(model_dir)


def test_backend_table_lists_moe_only_for_moe_models(variant, tmp_path):
    """`deltaserve backends` shows the moe family for a MoE model, not for a dense one."""
    from hf_models import SPECS_BY_NAME

    from deltaserve.backends import format_backend_table

    _, model_dir, _, _ = variant
    table = format_backend_table(str(model_dir), device="cpu", dtype="float32")
    assert re.search(r"^moe\s+torch\b", table, re.M), table
    dense_dir, _ = build_model(SPECS_BY_NAME["qwen3_5_r2_g3"], tmp_path / "d", load_oracle=False)
    dense = format_backend_table(str(dense_dir), device="cpu", dtype="float32")
    assert not re.search(r"^moe\b", dense, re.M), dense
