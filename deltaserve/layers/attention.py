"""Full (softmax) attention over a paged KV cache, with per-head q/k RMSNorm and rotary.

One class serves Qwen3 (no output gate) and Qwen3.5 / Qwen3-Next (`output_gate`: q_proj yields
per head [query | gate] and the attention output is multiplied by sigmoid(gate) before o_proj;
zero-centred q/k norms).
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.cache.spec import AttentionSpec
from deltaserve.distributed.parallel_state import tp_size
from deltaserve.distributed.sharding import divide, kv_head_replicas
from deltaserve.forward_context import ForwardContext
from deltaserve.layers.norms import RMSNorm
from deltaserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from deltaserve.layers.rotary import RotaryEmbedding, rotary_cos_sin


class Attention(nn.Module):
    """Attention over this tensor-parallel rank's heads (all of them without tensor
    parallelism). Head counts are global; each rank takes an even share of the q heads and of
    the kv heads, or, with fewer kv heads than ranks, the one kv head its q heads read.

    With `output_gate`, q_proj rows are per head [query | gate], so a contiguous split by heads
    keeps each head's query and gate together.
    """

    partial_output = "o_proj"  # see parallel_linear.leave_output_partial
    normed_input_projection = "qkv_proj"  # decoder.normed_input

    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        rms_norm_eps: float,
        bias: bool = False,
        output_gate: bool = False,
        zero_centered_norm: bool = False,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        tp = tp_size()
        self.num_heads = divide(num_heads, tp, "num_attention_heads", "attention query heads")
        # fewer kv heads than ranks: each kv head on `kv_replicas` ranks, the one its q heads
        # read (rank r's q heads all map to kv head r // kv_replicas)
        kv_replicas = kv_head_replicas(num_kv_heads, tp)
        self.num_kv_heads = num_kv_heads * kv_replicas // tp
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim  # this rank's
        self.kv_size = self.num_kv_heads * head_dim
        self.output_gate = output_gate
        q_rows = (2 if output_gate else 1) * self.q_size * tp  # per head [query | gate]
        self.qkv_proj = ColumnParallelLinear(
            hidden_size,
            {
                "q_proj": q_rows,
                "k_proj": num_kv_heads * head_dim,
                "v_proj": num_kv_heads * head_dim,
            },
            bias=bias,
            replicas={"k_proj": kv_replicas, "v_proj": kv_replicas},
        )
        self.o_proj = RowParallelLinear(self.q_size * tp, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps, zero_centered_norm)
        self.k_norm = RMSNorm(head_dim, rms_norm_eps, zero_centered_norm)
        self.rotary = rotary
        self.scale = head_dim**-0.5

    @property
    def cache_spec(self) -> AttentionSpec:
        """What this layer caches (this rank's heads): paged K and V."""
        return AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes the step's K / V into `ctx.caches[layer_idx]`
        (of the first `ctx.token_rows(T)` rows: the rest are padding, their output zero)."""
        parts = self.pre(positions, x, ctx)
        return self.post(self.core(parts, ctx), parts, ctx)

    # ---- the three pieces of a forward (engine/piecewise_graphs.py replays pre and post
    # from CUDA graphs over every row, and runs core eagerly over the step's tokens) ----------
    def pre(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor | None, ...]:
        """x [rows, hidden] -> (q [rows, Hq, D], k, v [rows, Hkv, D], gate [rows, Hq, D] or
        None): the projections, q / k norms and rotary; per row, reads no batch layout."""
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        gate = None
        if self.output_gate:
            q_gate = q.reshape(T, self.num_heads, 2 * D)  # per head [query | gate]
            q = q_gate[..., :D]  # [T, Hq, D] (strided view)
            gate = q_gate[..., D:]  # [T, Hq, D] (strided view)
        else:
            q = q.reshape(T, self.num_heads, D)  # [T, Hq, D]
        k = k.reshape(T, self.num_kv_heads, D)  # [T, Hkv, D]
        v = v.reshape(T, self.num_kv_heads, D)
        ops = ctx.kernels.fused
        cos, sin = rotary_cos_sin(self.rotary, positions, ctx)
        q, k = ops.qk_norm_rope(
            q,
            k,
            self.q_norm.weight,
            self.k_norm.weight,
            cos,
            sin,
            self.q_norm.eps,
            self.q_norm.zero_centered,
        )
        return q, k, v, gate

    def core_out_shape(self) -> tuple[int, ...]:
        """The trailing dims of `core`'s output: [T, Hq, D]."""
        return (self.num_heads, self.head_dim)

    def core(self, parts: tuple[torch.Tensor | None, ...], ctx: ForwardContext) -> torch.Tensor:
        """`pre`'s output -> the attention output [n, Hq, D] of the step's n =
        `ctx.token_rows(rows)` tokens, their K / V written to the paged cache first."""
        q, k, v, _ = parts
        n = ctx.token_rows(q.shape[0])
        if n != q.shape[0]:  # padded rows: the kernels see the step's tokens only
            q, k, v = q[:n], k[:n], v[:n]
        cache = ctx.caches[self.layer_idx]
        return ctx.kernels.attention.forward(
            q, k, v, cache["k_cache"], cache["v_cache"], ctx.meta, self.scale
        )  # [n, Hq, D]

    def post(
        self, o: torch.Tensor, parts: tuple[torch.Tensor | None, ...], ctx: ForwardContext
    ) -> torch.Tensor:
        """`core`'s output o [n, Hq, D] (n <= rows: the padded rows' output is zero) and
        `pre`'s -> [rows, hidden]: the output gate and o_proj."""
        gate = parts[3]
        rows, n = parts[0].shape[0], o.shape[0]
        if gate is not None:
            out = ctx.padded_out(rows, o)  # [rows, Hq, D] with zero padded rows, or None
            o = ctx.kernels.fused.sigmoid_gate_mul(
                o, gate[:n], out=None if out is None else out[:n]
            )
            o = o if out is None else out
        return self.o_proj(ctx.pad_rows(o, rows).reshape(rows, self.q_size))
