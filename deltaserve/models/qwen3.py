"""Qwen3 (dense attention with per-head q/k RMSNorm)."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.forward_context import ForwardContext
from deltaserve.layers.activations import silu_and_mul
from deltaserve.layers.linear import MergedLinear
from deltaserve.layers.norms import RMSNorm
from deltaserve.layers.rotary import rope_from_config
from deltaserve.models.base import AttentionSpec, CausalLM, LayerSpec


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden, {"gate_proj": intermediate, "up_proj": intermediate}
        )
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class Qwen3Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=bias,
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rope_from_config(config, self.head_dim)
        self.scale = self.head_dim**-0.5

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))  # [T, Hq, D]
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        cos, sin = self.rotary.cos_sin(positions)
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        cache = ctx.caches[self.layer_idx]
        o = ctx.kernels.attention.forward(
            q, k, v, cache.k_cache, cache.v_cache, ctx.meta, self.scale
        )
        return self.o_proj(o.reshape(T, self.q_size))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm (the `model.*` part of the checkpoint)."""

    def __init__(self, config, layers: list[nn.Module], zero_centered_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered_norm)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, ctx)
        return self.norm(x)


class Qwen3ForCausalLM(CausalLM):
    packed_modules = {
        "q_proj": ("qkv_proj", "q_proj"),
        "k_proj": ("qkv_proj", "k_proj"),
        "v_proj": ("qkv_proj", "v_proj"),
        "gate_proj": ("gate_up_proj", "gate_proj"),
        "up_proj": ("gate_up_proj", "up_proj"),
    }

    decoder_layer_cls: type[nn.Module] = Qwen3DecoderLayer
    zero_centered_norm = False

    def __init__(self, config, tie_word_embeddings: bool | None = None) -> None:
        """`tie_word_embeddings` comes from the checkpoint's top-level config (for multimodal
        checkpoints it may differ from the text config's)."""
        super().__init__()
        self.config = config
        layers = [self.decoder_layer_cls(config, i) for i in range(config.num_hidden_layers)]
        self.model = DecoderModel(config, layers, self.zero_centered_norm)
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_word_embeddings = tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def tied_parameters(self) -> dict[str, str]:
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.tie_word_embeddings else {}

    def layer_specs(self) -> list[LayerSpec]:
        return [
            AttentionSpec(a.num_heads, a.num_kv_heads, a.head_dim)
            for a in (layer.self_attn for layer in self.model.layers)
        ]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()
