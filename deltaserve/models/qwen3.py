"""Qwen3 (dense attention with per-head q/k RMSNorm)."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.distributed.parallel_state import tp_size
from deltaserve.distributed.sharding import divide
from deltaserve.forward_context import ForwardContext
from deltaserve.layers.norms import RMSNorm
from deltaserve.layers.parallel_linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from deltaserve.layers.rotary import rope_from_config
from deltaserve.models.base import AttentionSpec, CausalLM, LayerSpec
from deltaserve.ops.fused import FusedOps


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul. Under tensor
    parallelism each rank holds a slice of the intermediate features (gate and up column-split,
    down row-split and summed over ranks)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden, {"gate_proj": intermediate, "up_proj": intermediate}
        )
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


def attention_heads(config) -> tuple[int, int, int]:
    """(q heads, kv heads, head_dim) of this tensor-parallel rank: the heads split evenly."""
    total, total_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // total
    tp = tp_size()
    heads = divide(total, tp, "num_attention_heads", "attention query heads")
    kv_heads = divide(total_kv, tp, "num_key_value_heads", "attention kv heads")
    return heads, kv_heads, head_dim


class Qwen3Attention(nn.Module):
    """Attention over this rank's heads (all of them without tensor parallelism)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = attention_heads(config)
        self.q_size = self.num_heads * self.head_dim  # this rank's
        self.kv_size = self.num_kv_heads * self.head_dim
        tp = tp_size()
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            {"q_proj": self.q_size * tp, "k_proj": self.kv_size * tp, "v_proj": self.kv_size * tp},
            bias=bias,
        )
        self.o_proj = RowParallelLinear(self.q_size * tp, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rope_from_config(config, self.head_dim)
        self.scale = self.head_dim**-0.5

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.reshape(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        cos, sin = rotary_cos_sin(self.rotary, positions, ctx)
        q, k = ctx.kernels.fused.qk_norm_rope(
            q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps
        )
        cache = ctx.caches[self.layer_idx]
        o = ctx.kernels.attention.forward(
            q, k, v, cache["k_cache"], cache["v_cache"], ctx.meta, self.scale
        )
        return self.o_proj(o.reshape(T, self.q_size))


def rotary_cos_sin(
    rotary, positions: torch.Tensor, ctx: ForwardContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim / 2] of the step's positions, computed once per step."""
    key = ("rotary", rotary.rotary_dim, rotary.base)
    cached = ctx.memo.get(key)
    if cached is None:
        cached = ctx.memo[key] = rotary.cos_sin(positions)
    return cached


def residual_block(
    layer: nn.Module,
    mixer: nn.Module,
    positions: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    ctx: ForwardContext,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x = x + mixer(norm(x)); x = x + mlp(norm(x))` in the residual-stream form: returns the
    MLP output and the stream it must be added to (the add is fused into the next norm)."""
    ops = ctx.kernels.fused
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    if residual is None:  # first layer: the stream starts as the embeddings
        residual = x
        h = ops.rms_norm(x, n1.weight, n1.eps, n1.zero_centered)
    else:
        h, residual = ops.rms_norm(x, n1.weight, n1.eps, n1.zero_centered, residual=residual)
    h = mixer(positions, h, ctx)
    h, residual = ops.rms_norm(h, n2.weight, n2.eps, n2.zero_centered, residual=residual)
    return layer.mlp(h, ops), residual


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return residual_block(self, self.self_attn, positions, x, residual, ctx)


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm (the `model.*` part of the checkpoint)."""

    def __init__(self, config, layers: list[nn.Module], zero_centered_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered_norm)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        n = self.norm
        x, _ = ctx.kernels.fused.rms_norm(x, n.weight, n.eps, n.zero_centered, residual=residual)
        return x


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
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)

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
        return vocab_parallel_logits(hidden, weight, self.config.vocab_size)
