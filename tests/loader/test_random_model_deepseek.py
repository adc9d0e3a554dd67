"""DeepSeek-V2 random-weight presets (`--random-model deepseek-v2-lite | deepseek-v2`): the
configs carry the released shapes (config.json's legacy `rope_scaling`), the models build on the
meta device with latent caches, totals land within 1% of the published ones, and the latent
cache costs 576 x 2 bytes per token and layer in bf16. Under tensor parallelism 2 each rank
holds half the heads and the whole latent."""

from __future__ import annotations

import pytest
import torch

from deltaserve.bench.floors import model_costs
from deltaserve.cache.spec import MLASpec
from deltaserve.distributed import parallel_state
from deltaserve.layers.deepseek_moe import DeepseekMoeBlock
from deltaserve.layers.mlp import GatedMLP
from deltaserve.loader.random_model import ARCHITECTURES, init_random_weights, random_model_config
from deltaserve.models.registry import get_model_class

# name -> (layers, hidden, heads, q_lora_rank, experts, expert width, method, scaling, total)
RELEASED = {
    "deepseek-v2-lite": (27, 2048, 16, None, 64, 1408, "greedy", 1.0, 15.7e9),
    "deepseek-v2": (60, 5120, 128, 1536, 160, 1536, "group_limited_greedy", 16.0, 236e9),
}


def _meta_model(name: str):
    hf, text, arch = random_model_config(name)
    with torch.device("meta"):
        return get_model_class(arch)(text, tie_word_embeddings=hf.tie_word_embeddings)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_deepseek_preset_shapes_and_counts(name: str) -> None:
    layers, hidden, heads, q_lora, experts, inter, method, scaling, total = RELEASED[name]
    hf, text, arch = random_model_config(name)
    assert arch == ARCHITECTURES[name] == "DeepseekV2ForCausalLM" == hf.architectures[0]
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads) == (
        layers,
        hidden,
        heads,
    )
    assert text.q_lora_rank == q_lora and text.rope_parameters["rope_type"] == "yarn"
    model = _meta_model(name)
    assert model.layer_specs() == [MLASpec(heads, 512, 64)] * layers
    blocks = [layer.mlp for layer in model.model.layers]
    assert isinstance(blocks[0], GatedMLP)  # first_k_dense_replace 1
    assert all(isinstance(b, DeepseekMoeBlock) for b in blocks[1:])
    b = blocks[1]
    assert (b.op_spec.num_experts, b.op_spec.top_k, b.op_spec.intermediate_size) == (
        experts,
        6,
        inter,
    )
    assert (b.topk_method, b.routed_scaling_factor) == (method, scaling)
    # YaRN: mscale == mscale_all_dim, so cos / sin are unscaled and the softmax scale is
    # 192^-0.5 * (0.1 * 0.707 * ln 40 + 1)^2
    attn = model.model.layers[0].self_attn
    assert attn.rotary.attention_factor == 1.0
    assert abs(attn.scale - 192**-0.5 * (0.0707 * torch.tensor(40.0).log().item() + 1) ** 2) < 1e-6
    costs = model_costs(model, model.layer_specs(), torch.bfloat16, torch.float32)
    assert abs(costs.num_params - total) / total < 0.01, costs.num_params
    assert costs.kv_bytes_per_token == layers * 576 * 2
    per_head = layers * heads * (192 + 128) * 2  # K and V per head, as a plain paged cache
    assert per_head / costs.kv_bytes_per_token > 8


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_deepseek_preset_builds_per_rank_at_tp2(name: str, monkeypatch) -> None:
    _, text, _ = random_model_config(name)
    for rank in (0, 1):
        monkeypatch.setitem(parallel_state._STATE, "rank", rank)
        monkeypatch.setitem(parallel_state._STATE, "size", 2)
        model = _meta_model(name)
        heads = text.num_attention_heads // 2
        assert model.layer_specs()[0] == MLASpec(heads, 512, 64)
        attn = model.model.layers[0].self_attn
        kv_b = attn.kv_b_proj.weight
        assert kv_b.shape == (heads * 256, 512)
        latent = attn.fused_qkv_a_proj.shard_offsets["kv_a_proj_with_mqa"][1]
        assert latent == 576  # replicated


def test_random_weights_prepare_the_absorbed_halves() -> None:
    """init_random_weights runs the layers' after-loading hooks: kv_b_proj becomes W_UK / W_UV."""
    from transformers import DeepseekV2Config

    _, text, _ = random_model_config("deepseek-v2-lite")
    small = DeepseekV2Config(
        **{
            **text.to_dict(),
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 2,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8,
            "v_head_dim": 8,
            "n_routed_experts": 8,
            "moe_intermediate_size": 16,
            "vocab_size": 128,
        }
    )
    model = get_model_class("DeepseekV2ForCausalLM")(small)
    init_random_weights(model, seed=0)
    attn = model.model.layers[0].self_attn
    assert attn.kv_b_proj is None
    assert attn.w_uk.shape == (2, 8, 16) and attn.w_uv.shape == (2, 16, 8)
    assert torch.isfinite(attn.w_uk).all()
