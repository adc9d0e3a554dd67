"""MoE random-weight presets (`--random-model qwen3.5-35b-a3b | qwen3.5-122b-a10b |
qwen3-next-80b-a3b`): their configs build, the models build on the meta device (no memory)
with the released shapes, total parameters land within 1% of the published totals, and the
active parameters (every parameter once, the routed experts counted top-k of E) are those the
config implies. Under tensor parallelism 2 (the GPU kind the two large presets need) every
rank's model builds with half of each expert's width."""

from __future__ import annotations

import pytest
import torch

from deltaserve.bench.floors import model_costs
from deltaserve.distributed import parallel_state
from deltaserve.distributed.sharding import check_tp_shapes
from deltaserve.layers.moe import SparseMoeBlock
from deltaserve.loader.random_model import ARCHITECTURES, random_model_config
from deltaserve.models.registry import get_model_class

# name -> (architecture, layers, hidden, q / kv heads, GDN k / v heads, experts, top-k, expert
# width, shared width, vocabulary)
RELEASED = {
    "qwen3.5-35b-a3b": ("Qwen3_5MoeForCausalLM", 40, 2048, 16, 2, 16, 32, 256, 8, 512, 512, 248320),
    "qwen3.5-122b-a10b": (
        "Qwen3_5MoeForCausalLM", 48, 3072, 32, 2, 16, 64, 256, 8, 1024, 1024, 248320,
    ),
    "qwen3-next-80b-a3b": (
        "Qwen3NextForCausalLM", 48, 2048, 16, 2, 16, 32, 512, 10, 512, 512, 151936,
    ),
}  # fmt: skip

# name -> (published total, published active): the checkpoints' names and model cards
PUBLISHED = {
    "qwen3.5-35b-a3b": (35e9, 3e9),
    "qwen3.5-122b-a10b": (122e9, 10e9),
    "qwen3-next-80b-a3b": (80e9, 3e9),
}


def _meta_model(name: str):
    hf, text, arch = random_model_config(name)
    with torch.device("meta"):
        return get_model_class(arch)(text, tie_word_embeddings=hf.tie_word_embeddings)


def _expected_active(text) -> int:
    """Active parameters written out from the config: embedding, lm_head and final norm; per
    layer its two norms, its mixer, the router, shared expert and gate, and top-k experts."""
    h, v, d = text.hidden_size, text.vocab_size, text.head_dim
    q, kv = text.num_attention_heads, text.num_key_value_heads
    hk, hv = text.linear_num_key_heads, text.linear_num_value_heads
    k_dim, v_dim = text.linear_key_head_dim, text.linear_value_head_dim
    conv = 2 * hk * k_dim + hv * v_dim
    gdn = h * (conv + hv * v_dim + 2 * hv) + conv * text.linear_conv_kernel_dim
    gdn += 2 * hv + v_dim + hv * v_dim * h  # A_log, dt_bias, output norm, out_proj
    attention = h * (2 * q * d + 2 * kv * d) + q * d * h + 2 * d  # q (+gate), k, v, o, q/k norm
    e, i, s = text.num_experts, text.moe_intermediate_size, text.shared_expert_intermediate_size
    moe = h * e + 3 * h * s + h + text.num_experts_per_tok * 3 * h * i
    total = 2 * v * h + h
    for kind in text.layer_types:
        total += 2 * h + moe + (gdn if kind == "linear_attention" else attention)
    return total


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_moe_preset_shapes_and_counts(name: str) -> None:
    arch, layers, hidden, q, kv, hk, hv, experts, top_k, inter, shared, vocab = RELEASED[name]
    hf, text, architecture = random_model_config(name)
    assert architecture == arch == ARCHITECTURES[name] and hf.architectures == [arch]
    assert (text.num_hidden_layers, text.hidden_size, text.vocab_size) == (layers, hidden, vocab)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (q, kv, 256)
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (hk, hv)
    assert text.layer_types == [
        "full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)
    ]
    model = _meta_model(name)
    blocks = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(b, SparseMoeBlock) for b in blocks)  # every layer sparse
    spec = blocks[0].op_spec
    assert (spec.num_experts, spec.top_k, spec.intermediate_size) == (experts, top_k, inter)
    assert blocks[0].shared_down.in_features == shared
    assert model.lm_head is not None  # untied

    costs = model_costs(model, model.layer_specs(), torch.bfloat16, torch.float32)
    total, active = PUBLISHED[name]
    assert abs(costs.num_params - total) / total < 0.01, costs.num_params
    assert costs.active_params == _expected_active(text)
    # the names round: active within 30% of the name's figure, and far below the total
    assert abs(costs.active_params - active) / active < 0.3, costs.active_params
    expert_bytes = 2 * 3 * hidden * inter  # bf16 w13 + w2 of one expert
    assert costs.expert_bytes == (expert_bytes,) * layers


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_moe_preset_builds_per_rank_at_tp2(name: str, monkeypatch) -> None:
    """What `bench throughput --random-model NAME --tensor-parallel-size 2` builds on each
    rank (meta device: the shapes only)."""
    _, text, _ = random_model_config(name)
    check_tp_shapes(text, 2)
    full = _meta_model(name)
    for rank in (0, 1):
        monkeypatch.setitem(parallel_state._STATE, "rank", rank)
        monkeypatch.setitem(parallel_state._STATE, "size", 2)
        model = _meta_model(name)
        block = model.model.layers[0].mlp
        assert block.experts.w13.shape == (
            text.num_experts,
            text.moe_intermediate_size,
            text.hidden_size,
        )
        assert block.experts.w2.shape[-1] == text.moe_intermediate_size // 2
        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        full_routed = sum(p.numel() for n, p in full.named_parameters() if ".experts." in n)
        assert 2 * routed == full_routed
