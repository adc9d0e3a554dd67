"""Qwen3.5 (dense): Gated DeltaNet layers mixed with gated full attention.

Details that differ from Qwen3 (each has bitten other engines):
- RMSNorms are zero-centred, `norm(x) * (1 + w)`, everywhere except the GDN output norm, which
  is a plain gated RMSNorm `w * norm(x) * silu(z)`;
- full attention's q_proj yields per head `[query | gate]`; the attention output is multiplied
  by `sigmoid(gate)` before o_proj;
- partial NeoX rotary (`partial_rotary_factor`, 0.25); text-only mrope reduces to it;
- GDN: conv1d over [q | k | v], beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias),
  L2-normalised q and k (inside the kernel), value head j reads key head j // (HV / HK).
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.distributed.parallel_state import tp_size
from deltaserve.distributed.sharding import ShardRule, divide
from deltaserve.forward_context import ForwardContext
from deltaserve.layers.norms import GatedRMSNorm, RMSNorm
from deltaserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from deltaserve.layers.rotary import rope_from_config
from deltaserve.models.base import AttentionSpec, GDNSpec, LayerSpec
from deltaserve.models.qwen3 import (
    GatedMLP,
    Qwen3ForCausalLM,
    attention_heads,
    residual_block,
    rotary_cos_sin,
)


class Qwen3_5Attention(nn.Module):
    """Gated attention over this rank's heads. q_proj rows are per head [query | gate], so a
    contiguous split by heads keeps each head's query and gate together."""

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
            {
                "q_proj": 2 * self.q_size * tp,
                "k_proj": self.kv_size * tp,
                "v_proj": self.kv_size * tp,
            },
            bias=bias,
        )
        self.o_proj = RowParallelLinear(self.q_size * tp, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered=True)
        self.rotary = rope_from_config(config, self.head_dim)
        self.scale = self.head_dim**-0.5

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        T = x.shape[0]
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q_gate = q_gate.reshape(T, self.num_heads, 2 * self.head_dim)  # per head [query | gate]
        q = q_gate[..., : self.head_dim]  # [T, Hq, D] (strided view)
        gate = q_gate[..., self.head_dim :]  # [T, Hq, D] (strided view)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        ops = ctx.kernels.fused
        cos, sin = rotary_cos_sin(self.rotary, positions, ctx)
        q, k = ops.qk_norm_rope(
            q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps, True
        )
        cache = ctx.caches[self.layer_idx]
        o = ctx.kernels.attention.forward(
            q, k, v, cache["k_cache"], cache["v_cache"], ctx.meta, self.scale
        )  # [T, Hq, D]
        o = ops.sigmoid_gate_mul(o, gate)
        return self.o_proj(o.reshape(T, self.q_size))


class GatedDeltaNet(nn.Module):
    """A GDN layer over this rank's key and value heads (all of them without tensor
    parallelism). Ranks split HK and HV evenly, so the local value head j still reads local key
    head j // (HV / HK); the conv1d channels, A_log, dt_bias and the in_proj rows over
    [q | k | v | z | b | a] are split by the same heads. The output norm (per head) is
    replicated; out_proj is row-parallel."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        if hv % hk:
            raise ValueError(
                f"linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk})"
            )
        tp = tp_size()
        self.spec = GDNSpec(  # this rank's heads: its caches are sized from it
            num_k_heads=divide(hk, tp, "linear_num_key_heads", "GDN key heads"),
            num_v_heads=divide(hv, tp, "linear_num_value_heads", "GDN value heads"),
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
        )
        s = self.spec
        self.key_dim = s.num_k_heads * s.head_k_dim  # this rank's
        self.value_dim = s.num_v_heads * s.head_v_dim
        qkv_pieces = (self.key_dim * tp, self.key_dim * tp, self.value_dim * tp)  # [q | k | v]
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            {
                "in_proj_qkv": qkv_pieces,
                "in_proj_z": self.value_dim * tp,
                "in_proj_b": hv,
                "in_proj_a": hv,
            },
        )
        # the checkpoint's depthwise Conv1d weight [conv_dim, 1, kernel]; only its weight is used
        self.conv1d = nn.Conv1d(
            s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False
        )
        self.conv1d.tp_rules = {("weight", None): ShardRule(0, qkv_pieces)}
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads))
        self.tp_rules = {(p, None): ShardRule(0, (hv,)) for p in ("A_log", "dt_bias")}
        self.norm = GatedRMSNorm(s.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(self.value_dim * tp, config.hidden_size, bias=False)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        s = self.spec
        T = x.shape[0]
        qkv, z, b, a = self.in_proj.split(self.in_proj(x))
        cache = ctx.caches[self.layer_idx]
        gdn = ctx.kernels.gdn
        weight = self.conv1d.weight.view(s.conv_dim, s.conv_kernel)  # [conv_dim, W]
        qkv = gdn.conv1d(qkv, weight, cache["conv_state"], ctx.meta)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, s.num_k_heads, s.head_k_dim)
        k = k.reshape(T, s.num_k_heads, s.head_k_dim)
        v = v.reshape(T, s.num_v_heads, s.head_v_dim)
        o = gdn.gated_delta_rule(
            q, k, v, a, b, self.A_log, self.dt_bias, cache["ssm_state"], ctx.meta
        )  # [T, HV, V]
        z = z.reshape(T, s.num_v_heads, s.head_v_dim)  # [T, HV, V]
        o = ctx.kernels.fused.gated_rms_norm(o, z, self.norm.weight, self.norm.eps)
        return self.out_proj(o.reshape(T, self.value_dim))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        elif self.layer_type == "full_attention":
            self.self_attn = Qwen3_5Attention(config, layer_idx)
        else:
            raise ValueError(f"layer {layer_idx}: unknown layer type {self.layer_type!r}")
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, zero_centered=True)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.layer_type == "linear_attention" else self.self_attn

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return residual_block(self, self.mixer, positions, x, residual, ctx)


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

    decoder_layer_cls = Qwen3_5DecoderLayer
    zero_centered_norm = True

    def layer_specs(self) -> list[LayerSpec]:
        specs: list[LayerSpec] = []
        for layer in self.model.layers:
            if layer.layer_type == "linear_attention":
                specs.append(layer.linear_attn.spec)
            else:
                a = layer.self_attn
                specs.append(AttentionSpec(a.num_heads, a.num_kv_heads, a.head_dim))
        return specs


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The released Qwen3.5 checkpoints: text weights under `model.language_model.*`.

    The vision tower (`model.visual.*`) and the MTP head (`mtp.*`) are recognised and skipped.
    """

    skip_prefixes = ("mtp.", "model.visual.")
    prefix_map = (("model.language_model.", "model."),)
