"""Qwen3.5 (dense): Gated DeltaNet layers mixed with gated full attention.

Details that differ from Qwen3 (each has bitten other engines):
- RMSNorms are zero-centred, `norm(x) * (1 + w)`, everywhere except the GDN output norm, which
  is a plain gated RMSNorm `w * norm(x) * silu(z)`;
- full attention's q_proj yields per head `[query | gate]`; the attention output is multiplied
  by `sigmoid(gate)` before o_proj (`Attention(output_gate=True)`);
- partial NeoX rotary (`partial_rotary_factor`, 0.25); text-only mrope reduces to it;
- GDN: conv1d over [q | k | v], beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias),
  L2-normalised q and k (inside the kernel), value head j reads key head j // (HV / HK).
"""

from __future__ import annotations

from torch import nn

from deltaserve.layers.decoder import DecoderLayer
from deltaserve.layers.gdn import GatedDeltaNet
from deltaserve.layers.mlp import GatedMLP
from deltaserve.models.qwen3 import Qwen3ForCausalLM, attention_from_config


def gdn_from_config(config, layer_idx: int, cls: type = GatedDeltaNet) -> GatedDeltaNet:
    """The GDN layer (`cls`) of an HF Qwen3.5 / Qwen3-Next text config (global head counts)."""
    return cls(
        layer_idx,
        config.hidden_size,
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        config.linear_conv_kernel_dim,
        config.rms_norm_eps,
    )


class Qwen3_5ForCausalLM(Qwen3ForCausalLM):
    """`Qwen3_5ForCausalLM` (model_type qwen3_5_text)."""

    skip_prefixes = ("mtp.", "model.visual.")
    packed_modules = {
        **Qwen3ForCausalLM.packed_modules,
        "in_proj_qkv": ("in_proj", "in_proj_qkv"),
        "in_proj_z": ("in_proj", "in_proj_z"),
        "in_proj_b": ("in_proj", "in_proj_b"),
        "in_proj_a": ("in_proj", "in_proj_a"),
    }

    zero_centered_norm = True

    def mixer_for_linear_attention(self, config, layer_idx: int) -> nn.Module:
        """The GDN layer of a `linear_attention` layer (Qwen3-Next overrides its loading)."""
        return gdn_from_config(config, layer_idx)

    def ffn(self, config, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer `layer_idx` (a gated MLP; MoE models override)."""
        return GatedMLP(config.hidden_size, config.intermediate_size)

    def decoder_layer(self, config, layer_idx: int) -> nn.Module:
        """Decoder layer `layer_idx`: GDN (`linear_attn`) or gated attention (`self_attn`) by
        `config.layer_types`, then the feed-forward block (`ffn`)."""
        layer_type = config.layer_types[layer_idx]
        if layer_type == "linear_attention":
            name, mixer = "linear_attn", self.mixer_for_linear_attention(config, layer_idx)
        elif layer_type == "full_attention":
            mixer = attention_from_config(
                config, layer_idx, output_gate=True, zero_centered_norm=True
            )
            name = "self_attn"
        else:
            raise ValueError(f"layer {layer_idx}: unknown layer type {layer_type!r}")
        return DecoderLayer(
            name,
            mixer,
            self.ffn(config, layer_idx),
            config.hidden_size,
            config.rms_norm_eps,
            zero_centered_norm=True,
        )


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The released Qwen3.5 checkpoints: text weights under `model.language_model.*`.

    The vision tower (`model.visual.*`) and the MTP head (`mtp.*`) are recognised and skipped.
    """

    skip_prefixes = ("mtp.", "model.visual.")
    prefix_map = (("model.language_model.", "model."),)
