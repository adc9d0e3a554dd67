"""Qwen3 (dense attention with per-head q/k RMSNorm)."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.forward_context import ForwardContext
from deltaserve.layers.attention import Attention
from deltaserve.layers.decoder import DecoderLayer, DecoderStack
from deltaserve.layers.mlp import GatedMLP
from deltaserve.layers.parallel_linear import ParallelLMHead, vocab_parallel_logits
from deltaserve.layers.rotary import rope_from_config
from deltaserve.models.base import CausalLM


def attention_from_config(
    config, layer_idx: int, output_gate: bool = False, zero_centered_norm: bool = False
) -> Attention:
    """The full-attention layer of an HF text config (global head counts; the layer takes this
    rank's share)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Attention(
        layer_idx,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        head_dim,
        rope_from_config(config, head_dim),
        config.rms_norm_eps,
        bias=bool(getattr(config, "attention_bias", False)),
        output_gate=output_gate,
        zero_centered_norm=zero_centered_norm,
    )


class Qwen3ForCausalLM(CausalLM):
    packed_modules = {
        "q_proj": ("qkv_proj", "q_proj"),
        "k_proj": ("qkv_proj", "k_proj"),
        "v_proj": ("qkv_proj", "v_proj"),
        "gate_proj": ("gate_up_proj", "gate_proj"),
        "up_proj": ("gate_up_proj", "up_proj"),
    }

    zero_centered_norm = False

    def __init__(self, config, tie_word_embeddings: bool | None = None) -> None:
        """`tie_word_embeddings` comes from the checkpoint's top-level config (for multimodal
        checkpoints it may differ from the text config's)."""
        super().__init__()
        self.config = config
        layers = [self.decoder_layer(config, i) for i in range(config.num_hidden_layers)]
        self.model = DecoderStack(
            config.vocab_size,
            config.hidden_size,
            layers,
            config.rms_norm_eps,
            self.zero_centered_norm,
        )
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_word_embeddings = tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

    def decoder_layer(self, config, layer_idx: int) -> nn.Module:
        """Decoder layer `layer_idx`: attention and a gated MLP."""
        return DecoderLayer(
            "self_attn",
            attention_from_config(config, layer_idx),
            GatedMLP(config.hidden_size, config.intermediate_size),
            config.hidden_size,
            config.rms_norm_eps,
            self.zero_centered_norm,
        )

    def tied_parameters(self) -> dict[str, str]:
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.tie_word_embeddings else {}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_parallel_logits(hidden, weight, self.config.vocab_size)
