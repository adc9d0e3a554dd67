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

import torch
from torch import nn

from deltaserve.layers.decoder import DecoderLayer
from deltaserve.layers.gdn import GatedDeltaNet
from deltaserve.layers.mlp import GatedMLP
from deltaserve.models.mtp import MTPHead, num_mtp_layers
from deltaserve.models.qwen3 import Qwen3ForCausalLM, attention_from_config
from deltaserve.models.weight_names import WeightNameMap


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
    supports_mtp = True  # the checkpoint's `mtp.*` head (speculative method "mtp")

    def __init__(self, config, tie_word_embeddings: bool | None = None, with_mtp: bool = False):
        """`with_mtp`: also build the MTP head (`self.mtp`, deltaserve.models.mtp) and load its
        `mtp.*` tensors instead of skipping them."""
        super().__init__(config, tie_word_embeddings)
        self.mtp: MTPHead | None = None
        if with_mtp:
            n = num_mtp_layers(config)
            if n != 1:
                raise ValueError(f"an MTP head of {n} layers is not supported (only 1)")
            self.mtp = MTPHead(config.hidden_size, config.rms_norm_eps, self.mtp_layer(config))
            # NOTE: an instance attribute: the class keeps skipping `mtp.` for other runs
            self.skip_prefixes = tuple(p for p in self.skip_prefixes if p != "mtp.")

    def mtp_layer(self, config) -> nn.Module:
        """The MTP head's decoder layer: gated full attention (cache index 0: the head's own)
        and the feed-forward block of layer 0 (`ffn`: dense, or MoE for MoE models)."""
        mixer = attention_from_config(config, 0, output_gate=True, zero_centered_norm=True)
        return DecoderLayer(
            "self_attn",
            mixer,
            self.ffn(config, 0),
            config.hidden_size,
            config.rms_norm_eps,
            zero_centered_norm=True,
        )

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


class ImageTowerMixin:
    """A conditional-generation model's vision tower (`model.visual.*` in the checkpoint,
    `visual` here), built when the engine passes a `vision_config` (images enabled); without
    one the tower's tensors are recognised and skipped, as for a text-only run."""

    supports_images = True
    visual: nn.Module | None

    def _build_visual(self, vision_config) -> None:
        from deltaserve.models.qwen3_5_vision import Qwen3_5VisionTower

        self.visual = None if vision_config is None else Qwen3_5VisionTower(vision_config)

    def weight_name_map(self) -> WeightNameMap:
        skip = self.skip_prefixes
        prefix_map = self.prefix_map
        if self.visual is not None:
            skip = tuple(p for p in skip if p != "model.visual.")
            prefix_map = (*prefix_map, ("model.visual.", "visual."))
        return WeightNameMap(skip, prefix_map, self.packed_modules, self.weight_rules)

    def encode_images(self, pixel_values: torch.Tensor, grids: list) -> list[torch.Tensor]:
        """Patches of several images (concatenated) -> each image's embeddings
        [t * h * w / merge^2, hidden], in order."""
        if self.visual is None:
            raise ValueError("this model was built without its vision tower")
        out = self.visual(pixel_values, [list(g) for g in grids])
        return list(out.split([self.visual.num_tokens(g) for g in grids]))


class Qwen3_5ForConditionalGeneration(ImageTowerMixin, Qwen3_5ForCausalLM):
    """The released Qwen3.5 checkpoints: text weights under `model.language_model.*`, the
    vision tower under `model.visual.*` (deltaserve.models.qwen3_5_vision); the MTP head
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
