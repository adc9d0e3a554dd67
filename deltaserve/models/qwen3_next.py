"""Qwen3-Next: the Qwen3.5-MoE hybrid (Gated DeltaNet + gated full attention, sparse MoE with a
gated shared expert), as HF transformers' modeling_qwen3_next has it.

What differs from Qwen3.5-MoE (everything else is the same math: zero-centred `(1 + w)` RMSNorms
everywhere except the GDN's plain gated output norm, q_proj's per-head `[query | gate]` with
`sigmoid(gate)` on the attention output, partial NeoX rotary (plain rope, no mrope), conv1d over
[q | k | v] with SiLU, `g = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`):
- the GDN input projections are two checkpoint tensors interleaved per key head,
  `in_proj_qkvz` and `in_proj_ba` (deltaserve.layers.gdn.InterleavedGDNInProj de-interleaves
  them once, at load);
- layer i is a sparse MoE block only when `i not in mlp_only_layers` and
  `(i + 1) % decoder_sparse_step == 0` (and num_experts > 0); otherwise a dense gated MLP of
  `intermediate_size`;
- routing renormalises the top-k probabilities only when `norm_topk_prob` is true;
- `layer_types` defaults from `full_attention_interval` (HF's config fills it in).

Experts: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (the released checkpoints and HF
save_pretrained) or fused `mlp.experts.gate_up_proj` / `down_proj`, as for Qwen3.5-MoE.
"""

from __future__ import annotations

from torch import nn

from deltaserve.layers.gdn import InterleavedGatedDeltaNet
from deltaserve.layers.mlp import GatedMLP
from deltaserve.layers.moe import SparseMoeBlock
from deltaserve.models.qwen3 import Qwen3ForCausalLM
from deltaserve.models.qwen3_5 import gdn_from_config
from deltaserve.models.qwen3_5_moe import Qwen3_5MoeForCausalLM


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether HF Qwen3-Next builds layer `layer_idx`'s feed-forward as a sparse MoE block."""
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and getattr(config, "num_experts", 0) > 0
        and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    )


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """`Qwen3NextForCausalLM` (model_type qwen3_next)."""

    skip_prefixes = ("mtp.",)
    packed_modules = {
        **Qwen3ForCausalLM.packed_modules,
        "in_proj_qkvz": ("in_proj", "in_proj_qkvz"),
        "in_proj_ba": ("in_proj", "in_proj_ba"),
    }

    def mixer_for_linear_attention(self, config, layer_idx: int) -> nn.Module:
        return gdn_from_config(config, layer_idx, InterleavedGatedDeltaNet)

    def ffn(self, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return GatedMLP(config.hidden_size, config.intermediate_size)
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            config.shared_expert_intermediate_size,
            bool(getattr(config, "norm_topk_prob", True)),
        )
