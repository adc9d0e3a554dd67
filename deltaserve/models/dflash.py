"""The DFlash block-diffusion drafter (z-lab's `DFlashDraftModel`): math only.

A drafter is a small Qwen3 decoder stack that reads the target's hidden states:

- context: the outputs of the target layers `target_layer_ids` (residual stream, before the
  final norm) at each accepted position, concatenated -> `c = hidden_norm(fc(taps))` [N, H].
  For every draft layer, `K = rope(k_norm(k_proj(c)))` and `V = v_proj(c)` at the context
  positions are written into the drafter's own paged KV cache once (no input_layernorm on c);
- block: `[last accepted token, MASK x (B - 1)]` at the next B positions, embedded with the
  target's table; each layer's queries, keys and values of the block come from the normed
  block stream (Qwen3 q/k norm and rotary), and attention runs over every context position plus
  the whole block: non-causal inside the block unless the layer is causal and / or
  sliding-window (`DFlashConfig.layer_causal` / `layer_window`). The block's own K / V are
  never cached.
- draft i (0-based) is read from block position i + 1 through the target's lm_head.

The block forward reaches its attention through `DraftContext.attend` (the drafter engine
supplies it: paged context plus the block, deltaserve/spec/dflash/attention.py), and its fused
elementwise ops through `DraftContext.kernels.fused`, like the target's layers.

Checkpoint names: `fc.weight [H, n_taps * H]`, `hidden_norm.weight`, `norm.weight`,
`layers.N.{input_layernorm, post_attention_layernorm}.weight`,
`layers.N.self_attn.{q,k,v,o}_proj.weight` (+ bias with `attention_bias`),
`layers.N.self_attn.{q,k}_norm.weight`, `layers.N.mlp.{gate,up,down}_proj.weight`; no embedding
and no lm_head (the target's are shared).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.cache.spec import AttentionSpec
from deltaserve.forward_context import Kernels
from deltaserve.layers.decoder import DecoderLayer
from deltaserve.layers.mlp import GatedMLP
from deltaserve.layers.norms import RMSNorm
from deltaserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from deltaserve.layers.rotary import RotaryEmbedding, rotary_cos_sin
from deltaserve.models.base import CausalLM
from deltaserve.ops.fused.reference import apply_rotary
from deltaserve.spec.dflash.config import DFlashConfig

# (layer index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], causal, window, scale) -> [T, Hq, D]
AttendFn = Callable[
    [int, torch.Tensor, torch.Tensor, torch.Tensor, bool, "int | None", float], torch.Tensor
]


@dataclass
class DraftContext:
    """What the drafter's block forward sees besides embeddings and positions: the attention
    over (cached context + this block) per layer, and the fused ops."""

    attend: AttendFn
    kernels: Kernels = field(default_factory=Kernels)
    memo: dict[Any, Any] = field(default_factory=dict)  # rotary cos / sin of the step


class DFlashAttention(nn.Module):
    """A draft layer's attention. q / k / v are fused into `qkv_proj` (filled from the
    checkpoint's q_proj, k_proj, v_proj); the context path uses only its k / v rows."""

    def __init__(self, layer_idx: int, cfg: DFlashConfig) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        D = self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.q_size = self.num_heads * D
        self.kv_size = self.num_kv_heads * D
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size},
            bias=cfg.attention_bias,
        )
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(D, int(D * cfg.partial_rotary_factor), float(cfg.rope_theta))
        self.scale = D**-0.5
        self.causal = cfg.layer_causal(layer_idx)
        self.window = cfg.layer_window(layer_idx)

    @property
    def cache_spec(self) -> AttentionSpec:
        """Paged K / V of the context positions."""
        return AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim)

    def context_kv(
        self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: Kernels
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """c [N, H] (the projected context, NOT normed by input_layernorm) -> K, V
        [N, Hkv, D]: K = rope(k_norm(k_proj(c))), V = v_proj(c)."""
        N, D = c.shape[0], self.head_dim
        w = self.qkv_proj.weight[self.q_size :]  # [2 * kv_size, H]: the k and v rows
        b = None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size :]
        kv = F.linear(c, w, b)  # [N, 2 * kv_size]
        k = kv[:, : self.kv_size].reshape(N, self.num_kv_heads, D)
        v = kv[:, self.kv_size :].reshape(N, self.num_kv_heads, D)
        n = self.k_norm
        k = kernels.fused.rms_norm(k, n.weight, n.eps)
        return apply_rotary(k, cos, sin), v

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: DraftContext) -> torch.Tensor:
        """x [T, H] (the normed block stream) -> [T, H], attending over context + block."""
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.reshape(T, self.num_heads, D)  # [T, Hq, D]
        k = k.reshape(T, self.num_kv_heads, D)  # [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, D)
        cos, sin = rotary_cos_sin(self.rotary, positions, ctx)
        n = self.q_norm
        q, k = ctx.kernels.fused.qk_norm_rope(q, k, n.weight, self.k_norm.weight, cos, sin, n.eps)
        o = ctx.attend(self.layer_idx, q, k, v, self.causal, self.window, self.scale)
        return self.o_proj(o.reshape(T, self.q_size))


class DFlashDraftModel(CausalLM):
    """fc + hidden_norm (the context projection), Qwen3 decoder layers, final norm."""

    packed_modules = {
        "q_proj": ("qkv_proj", "q_proj"),
        "k_proj": ("qkv_proj", "k_proj"),
        "v_proj": ("qkv_proj", "v_proj"),
        "gate_proj": ("gate_up_proj", "gate_proj"),
        "up_proj": ("gate_up_proj", "up_proj"),
    }

    def __init__(self, config: DFlashConfig, tie_word_embeddings: bool | None = None) -> None:
        """`tie_word_embeddings` is accepted for `loader.weights.build_model` and ignored: the
        drafter has no embedding or lm_head of its own."""
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.layers = nn.ModuleList(
            DecoderLayer(
                "self_attn",
                DFlashAttention(i, config),
                GatedMLP(H, config.intermediate_size),
                H,
                config.rms_norm_eps,
            )
            for i in range(config.num_hidden_layers)
        )
        self.fc = nn.Linear(config.num_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.norm = RMSNorm(H, config.rms_norm_eps)

    def layer_specs(self) -> list[AttentionSpec]:
        return [layer.mixer.cache_spec for layer in self.layers]

    def capability_specs(self) -> list:
        return list(self.layer_specs())

    def project_context(self, taps: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """taps [N, n_taps * H] (the tapped target layers' outputs, in target_layer_ids order,
        concatenated) -> c = hidden_norm(fc(taps)) [N, H]."""
        n = self.hidden_norm
        return kernels.fused.rms_norm(self.fc(taps), n.weight, n.eps)

    def context_kv(
        self, taps: torch.Tensor, positions: torch.Tensor, kernels: Kernels
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [N, n_taps * H] at `positions` [N] -> per draft layer (K, V) [N, Hkv, D]."""
        c = self.project_context(taps, kernels)
        out = []
        for layer in self.layers:
            attn = layer.mixer
            cos, sin = attn.rotary.cos_sin(positions)
            out.append(attn.context_kv(c, cos, sin, kernels))
        return out

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, ctx: DraftContext
    ) -> torch.Tensor:
        """The block forward: embeds [T, H] (target-embedded block tokens, already scaled by
        `input_embedding_scale`), positions [T] -> final-normed hidden states [T, H]."""
        x, residual = embeds, None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        n = self.norm
        x, _ = ctx.kernels.fused.rms_norm(x, n.weight, n.eps, residual=residual)
        return x

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target lm_head's logits at the block -> the drafter's logits
        (`output_multiplier`, then `final_logit_softcapping` when set)."""
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
