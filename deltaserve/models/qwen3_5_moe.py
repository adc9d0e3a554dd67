"""Qwen3.5-MoE: the Qwen3.5 hybrid (Gated DeltaNet + gated full attention) with a sparse MoE
block in every layer (deltaserve.layers.moe).

Checkpoint names (HF transformers' modeling_qwen3_5_moe): `mlp.gate.weight` [E, H] (the router),
`mlp.shared_expert.{gate,up,down}_proj.weight`, `mlp.shared_expert_gate.weight` [1, H], and the
routed experts either fused as released (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows
first, and `mlp.experts.down_proj` [E, H, I], each used as `F.linear(x, w[e])`) or per expert
(`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]: what HF 5.x
`save_pretrained` writes). Routing: softmax in float32 over all experts, top-k, renormalised
(HF always renormalises; `norm_topk_prob`, when a config has it, is honoured).
"""

from __future__ import annotations

from torch import nn

from deltaserve.layers.moe import SparseMoeBlock
from deltaserve.models.qwen3_5 import ImageTowerMixin, Qwen3_5ForCausalLM
from deltaserve.models.weight_names import EXPERT_WEIGHT_RULES, WeightRule


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """`Qwen3_5MoeForCausalLM` (model_type qwen3_5_moe_text)."""

    weight_rules = (
        *EXPERT_WEIGHT_RULES,
        # one projection for everything that reads x (deltaserve.layers.moe.SparseMoeBlock)
        WeightRule("mlp.shared_expert.gate_proj.weight", "mlp.in_proj.weight", "shared_gate_proj"),
        WeightRule("mlp.shared_expert.up_proj.weight", "mlp.in_proj.weight", "shared_up_proj"),
        WeightRule("mlp.gate.weight", "mlp.in_proj.weight", "gate"),
        WeightRule("mlp.shared_expert_gate.weight", "mlp.in_proj.weight", "shared_expert_gate"),
        WeightRule("mlp.shared_expert.down_proj.weight", "mlp.shared_down.weight"),
    )

    def ffn(self, config, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            config.shared_expert_intermediate_size,
            bool(getattr(config, "norm_topk_prob", True)),
        )


class Qwen3_5MoeForConditionalGeneration(ImageTowerMixin, Qwen3_5MoeForCausalLM):
    """The released Qwen3.5-MoE checkpoints: text weights under `model.language_model.*`, the
    vision tower (the same as the dense model's) under `model.visual.*`; the MTP head
    (`mtp.*`) is skipped unless built (`with_mtp`)."""

    skip_prefixes = ("mtp.", "model.visual.")
    prefix_map = (("model.language_model.", "model."),)

    def __init__(
        self,
        config,
        tie_word_embeddings: bool | None = None,
        vision_config=None,
        with_mtp: bool = False,
    ):
        super().__init__(config, tie_word_embeddings, with_mtp=with_mtp)
        self._build_visual(vision_config)
