"""DeepSeek-V2 / DeepSeek-V2-Lite: multi-head latent attention (deltaserve.layers.mla) and a
DeepSeek MoE block (deltaserve.layers.deepseek_moe), as HF transformers' modeling_deepseek_v2.

Layers `0 .. first_k_dense_replace - 1` have a dense gated MLP of `intermediate_size`; the rest
a MoE block (`n_routed_experts` experts of `moe_intermediate_size`, top `num_experts_per_tok`
by `topk_method`, weights times `routed_scaling_factor`, plus `n_shared_experts` ungated shared
experts). Plain RMSNorms (`w * x`) everywhere. config.json's `head_dim` is the rope dim (HF
writes `qk_rope_head_dim` there): the head size is nope + rope for q / k and `v_head_dim` for v.
The softmax scale is (nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN.

Checkpoint names: `self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`,
`self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}`, `mlp.{gate,up,down}_proj`
(dense layers), `mlp.gate`, `mlp.experts.{e}.*`, `mlp.shared_experts.*`.
"""

from __future__ import annotations

from torch import nn

from deltaserve.layers.decoder import DecoderLayer
from deltaserve.layers.deepseek_moe import DeepseekMoeBlock
from deltaserve.layers.mla import MLAttention
from deltaserve.layers.mlp import GatedMLP
from deltaserve.layers.yarn import deepseek_rope_from_config
from deltaserve.models.qwen3 import Qwen3ForCausalLM
from deltaserve.models.weight_names import EXPERT_WEIGHT_RULES, WeightRule


class DeepseekV2ForCausalLM(Qwen3ForCausalLM):
    """`DeepseekV2ForCausalLM` (model_type deepseek_v2)."""

    packed_modules = {
        "q_proj": ("fused_qkv_a_proj", "q_proj"),
        "q_a_proj": ("fused_qkv_a_proj", "q_a_proj"),
        "kv_a_proj_with_mqa": ("fused_qkv_a_proj", "kv_a_proj_with_mqa"),
        "q_b_proj": ("q_b_proj", "q_b_proj"),
        "kv_b_proj": ("kv_b_proj", "kv_b_proj"),
        "gate_proj": ("gate_up_proj", "gate_proj"),
        "up_proj": ("gate_up_proj", "up_proj"),
    }
    weight_rules = (
        *EXPERT_WEIGHT_RULES,
        WeightRule(
            "mlp.shared_experts.gate_proj.weight", "mlp.shared_in_proj.weight", "shared_gate_proj"
        ),
        WeightRule(
            "mlp.shared_experts.up_proj.weight", "mlp.shared_in_proj.weight", "shared_up_proj"
        ),
        WeightRule("mlp.shared_experts.down_proj.weight", "mlp.shared_down.weight"),
    )

    def __init__(self, config, tie_word_embeddings: bool | None = None) -> None:
        for key in ("attention_bias", "mlp_bias"):
            if getattr(config, key, False):
                raise ValueError(f"DeepseekV2: {key}=true is not supported")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"DeepseekV2: hidden_act {config.hidden_act!r} is not supported")
        self.rotary, scale_mult = deepseek_rope_from_config(config, config.qk_rope_head_dim)
        qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.softmax_scale = qk_dim**-0.5 * scale_mult
        super().__init__(config, tie_word_embeddings)

    def decoder_layer(self, config, layer_idx: int) -> nn.Module:
        """Decoder layer `layer_idx`: latent attention and a dense MLP or a MoE block."""
        attn = MLAttention(
            layer_idx,
            config.hidden_size,
            config.num_attention_heads,
            config.q_lora_rank,
            config.kv_lora_rank,
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
            self.rotary,
            self.softmax_scale,
        )
        return DecoderLayer(
            "self_attn", attn, self.ffn(config, layer_idx), config.hidden_size, config.rms_norm_eps
        )

    def ffn(self, config, layer_idx: int) -> nn.Module:
        routed = getattr(config, "n_routed_experts", None)
        if not routed or layer_idx < getattr(config, "first_k_dense_replace", 0):
            return GatedMLP(config.hidden_size, config.intermediate_size)
        return DeepseekMoeBlock(
            config.hidden_size,
            routed,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            getattr(config, "n_shared_experts", 0) or 0,
            getattr(config, "topk_method", "greedy") or "greedy",
            getattr(config, "n_group", None),
            getattr(config, "topk_group", None),
            float(getattr(config, "routed_scaling_factor", 1.0)),
            bool(getattr(config, "norm_topk_prob", False)),
        )
