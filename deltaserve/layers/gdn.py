"""Gated DeltaNet (GDN) layer: the linear-attention mixer of Qwen3.5 / Qwen3-Next.

Per token: conv1d over [q | k | v] (causal, depthwise, state in the conv pool), beta =
sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the gated delta rule on the recurrent state
(q and k L2-normalised inside the kernel; value head j reads key head j // (HV / HK)), then the
gated output norm `w * norm(o) * silu(z)` and out_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.cache.spec import GDNSpec
from deltaserve.distributed.parallel_state import tp_rank, tp_size
from deltaserve.distributed.sharding import ShardRule, divide
from deltaserve.forward_context import ForwardContext
from deltaserve.layers.norms import GatedRMSNorm
from deltaserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from deltaserve.ops.gdn import OutputNorm, one_token_decodes
from deltaserve.ops.linear import ConvEpilogue


class GatedDeltaNet(nn.Module):
    """A GDN layer over this rank's key and value heads (all of them without tensor
    parallelism). Head counts are global; ranks split HK and HV evenly, so the local value head
    j still reads local key head j // (HV / HK); the conv1d channels, A_log, dt_bias and the
    in_proj rows over [q | k | v | z | b | a] are split by the same heads. The output norm (per
    head) is replicated; out_proj is row-parallel."""

    partial_output = "out_proj"  # parallel_linear.leave_output_partial
    normed_input_projection = "in_proj"  # decoder.normed_input

    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        rms_norm_eps: float,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hk, hv = num_k_heads, num_v_heads
        if hv % hk:
            raise ValueError(
                f"linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk})"
            )
        tp = tp_size()
        self.spec = GDNSpec(  # this rank's heads: its caches are sized from it
            num_k_heads=divide(hk, tp, "linear_num_key_heads", "GDN key heads"),
            num_v_heads=divide(hv, tp, "linear_num_value_heads", "GDN value heads"),
            head_k_dim=head_k_dim,
            head_v_dim=head_v_dim,
            conv_kernel=conv_kernel,
        )
        s = self.spec
        self.key_dim = s.num_k_heads * s.head_k_dim  # this rank's
        self.value_dim = s.num_v_heads * s.head_v_dim
        qkv_pieces = (self.key_dim * tp, self.key_dim * tp, self.value_dim * tp)  # [q | k | v]
        shards = {
            "in_proj_qkv": qkv_pieces,
            "in_proj_z": self.value_dim * tp,
            "in_proj_b": hv,
            "in_proj_a": hv,
        }
        self.in_proj = self.make_in_proj(hidden_size, shards, hk, hv, head_k_dim, head_v_dim)
        # the checkpoint's depthwise Conv1d weight [conv_dim, 1, kernel]; only its weight is used
        self.conv1d = nn.Conv1d(
            s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False
        )
        self.conv1d.tp_rules = {("weight", None): ShardRule(0, qkv_pieces)}
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads))
        self.tp_rules = {(p, None): ShardRule(0, (hv,)) for p in ("A_log", "dt_bias")}
        self.norm = GatedRMSNorm(s.head_v_dim, rms_norm_eps)
        self.out_proj = RowParallelLinear(self.value_dim * tp, hidden_size, bias=False)

    def make_in_proj(
        self,
        hidden_size: int,
        shards: dict[str, int | tuple[int, ...]],
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
    ) -> ColumnParallelLinear:
        """The fused input projection over [q | k | v | z | b | a] (`shards`, global sizes),
        loaded from Qwen3.5's split checkpoint projections (in_proj_qkv, _z, _b, _a)."""
        return ColumnParallelLinear(hidden_size, shards)

    @property
    def cache_spec(self) -> GDNSpec:
        """What this layer caches (this rank's heads): one conv and one SSM state per slot."""
        return self.spec

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """x [rows, hidden] -> [rows, hidden]; updates the states of `ctx.caches[layer_idx]` in
        place from the first `ctx.token_rows(rows)` rows (the rest are padding, their output
        zero). `positions` is unused (the recurrence carries order).

        Decode steps may fold two launches into their neighbours (both opt-in): the conv1d
        update into the in_proj's GEMV at batch 1 (`_conv_in_projection`), the output norm
        into the delta rule's launch (`GDNKernels.decode_fuses_gated_norm`)."""
        fused_conv = self._conv_in_projection(x, ctx)
        fused_norm = ctx.spec_verify is None and ctx.kernels.gdn.decode_fuses_gated_norm(ctx.meta)
        if not (fused_conv or fused_norm):
            parts = self.pre(positions, x, ctx)
            return self.post(self.core(parts, ctx), parts, ctx)
        s = self.spec
        cache = ctx.caches[self.layer_idx]
        if fused_conv:  # a batch-1 decode step: the conv1d update in the in_proj's launch
            conv = ConvEpilogue(
                self.conv1d.weight.view(s.conv_dim, s.conv_kernel),  # [conv_dim, W]
                cache["conv_state"],
                ctx.meta.state_slots[:1],
            )
            proj = self.in_proj
            parts = (proj.decode_gemm.conv(x, proj.weight, proj.bias, conv),)
            qkv, z, b, a = proj.split(parts[0][:1])
        else:
            parts = self.pre(positions, x, ctx)
            qkv, z, b, a = self._split_conv(parts[0], cache, ctx)
        if not fused_norm:
            return self.post(self._delta_rule(qkv, b, a, cache, ctx), parts, ctx)
        # the delta rule with the output norm in its launch, then out_proj
        rows, T = parts[0].shape[0], qkv.shape[0]
        z = z.reshape(T, s.num_v_heads, s.head_v_dim)  # [T, HV, V]
        norm = OutputNorm(z, self.norm.weight, self.norm.eps)
        o = self._delta_rule(qkv, b, a, cache, ctx, norm)
        return self.out_proj(ctx.pad_rows(o, rows).reshape(rows, self.value_dim))

    def _conv_in_projection(self, x: torch.Tensor, ctx: ForwardContext) -> bool:
        """Whether this step runs the conv1d update inside the in_proj (the decode GEMM's
        `fuses_conv`, DELTASERVE_GDN_CONV_GEMV=fused): one decode row of one token and nothing
        else (no prefill part, no verify step to record, no checkpoint)."""
        gemm = self.in_proj.decode_gemm
        return (
            gemm is not None
            and gemm.fuses_conv(x.shape[0])
            and ctx.spec_verify is None
            and ctx.meta.num_decodes == 1
            and one_token_decodes(ctx.meta)
        )

    # ---- the three pieces of a forward (engine/piecewise_graphs.py replays pre and post
    # from CUDA graphs over every row, and runs core eagerly over the step's tokens) ----------
    def pre(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, ...]:
        """x [rows, hidden] -> (the fused in_proj output [rows, qkv + z + b + a],); per row,
        reads no batch layout or cache."""
        return (self.in_proj(x),)

    def core_out_shape(self) -> tuple[int, ...]:
        """The trailing dims of `core`'s output: [T, HV, V]."""
        return (self.spec.num_v_heads, self.spec.head_v_dim)

    def core(self, parts: tuple[torch.Tensor, ...], ctx: ForwardContext) -> torch.Tensor:
        """`pre`'s output -> the delta rule's output [T, HV, V] of the step's T =
        `ctx.token_rows(rows)` tokens: conv1d and the gated delta rule over the batch layout,
        updating this layer's conv and SSM states in place."""
        cache = ctx.caches[self.layer_idx]
        qkv, _, b, a = self._split_conv(parts[0], cache, ctx)
        return self._delta_rule(qkv, b, a, cache, ctx)

    def _split_conv(
        self, y: torch.Tensor, cache: dict[str, torch.Tensor], ctx: ForwardContext
    ) -> tuple[torch.Tensor, ...]:
        """The fused in_proj output [rows, ...] -> (the conv1d output [T, conv_dim], z, b, a)
        of the step's T tokens (rows after them are padding), the conv state updated in place;
        a verify step's inputs recorded first (what a rollback replays)."""
        s = self.spec
        T = ctx.token_rows(y.shape[0])
        qkv, z, b, a = self.in_proj.split(y[:T])
        if ctx.spec_verify is not None:
            ctx.spec_verify.record(self.layer_idx, qkv, b, a, cache)
        weight = self.conv1d.weight.view(s.conv_dim, s.conv_kernel)  # [conv_dim, W]
        qkv = ctx.kernels.gdn.conv1d(qkv, weight, cache["conv_state"], ctx.meta)
        return qkv, z, b, a

    def _delta_rule(
        self,
        qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        cache: dict[str, torch.Tensor],
        ctx: ForwardContext,
        norm: OutputNorm | None = None,
    ) -> torch.Tensor:
        """The conv's output qkv [T, conv_dim] and the gate inputs b, a [T, HV] -> the gated
        delta rule's output [T, HV, V] (with `norm`: normed and gated in the decode's launch),
        updating the layer's SSM state in place."""
        s = self.spec
        T = qkv.shape[0]
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, s.num_k_heads, s.head_k_dim)
        k = k.reshape(T, s.num_k_heads, s.head_k_dim)
        v = v.reshape(T, s.num_v_heads, s.head_v_dim)
        return ctx.kernels.gdn.gated_delta_rule(
            q, k, v, a, b, self.A_log, self.dt_bias, cache["ssm_state"], ctx.meta, norm
        )  # [T, HV, V]

    def post(
        self, o: torch.Tensor, parts: tuple[torch.Tensor, ...], ctx: ForwardContext
    ) -> torch.Tensor:
        """`core`'s output o [T, HV, V] (T <= rows: the padded rows' output is zero) and
        `pre`'s -> [rows, hidden]: the gated output norm and out_proj."""
        s = self.spec
        (y,) = parts
        rows, T = y.shape[0], o.shape[0]
        z = self.in_proj.split(y[:T])[1].reshape(T, s.num_v_heads, s.head_v_dim)  # [T, HV, V]
        out = ctx.padded_out(rows, o)  # [rows, HV, V] with zero padded rows, or None
        o = ctx.kernels.fused.gated_rms_norm(
            o, z, self.norm.weight, self.norm.eps, out=None if out is None else out[:T]
        )
        o = o if out is None else out
        return self.out_proj(o.reshape(rows, self.value_dim))


class InterleavedGDNInProj(ColumnParallelLinear):
    """GDN's fused in_proj over [q | k | v | z | b | a], loaded from Qwen3-Next's two
    checkpoint projections, whose rows are INTERLEAVED per key head g (r = HV / HK):

    - `in_proj_qkvz` [HK * (2K + 2rV), H]: for each g, `[q_g (K) | k_g (K) | v_g (rV) | z_g (rV)]`
      (v_g holds value heads g*r .. g*r + r - 1, as does z_g);
    - `in_proj_ba` [HK * 2r, H]: for each g, `[b_g (r) | a_g (r)]`.

    `load_weight` de-interleaves each once, into the split layout (q, k, v, z, b and a each
    contiguous, heads in order), then cuts this rank's share like the split projections.
    """

    checkpoint_shards = ("in_proj_qkvz", "in_proj_ba")

    def __init__(
        self,
        hidden_size: int,
        shards: dict[str, int | tuple[int, ...]],
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
    ) -> None:
        super().__init__(hidden_size, shards)
        self.heads = (num_k_heads, num_v_heads, head_k_dim, head_v_dim)

    def weight_slots(self, attr: str) -> list[tuple[str, None]]:
        return [(shard, None) for shard in self.checkpoint_shards]

    def weight_shape(self, attr: str, shard: str | None, expert: int | None) -> tuple[int, int]:
        hk, hv, k, v = self.heads
        rows = {"in_proj_qkvz": 2 * hk * k + 2 * hv * v, "in_proj_ba": 2 * hv}[shard]
        return (rows, self.in_features)

    def deinterleave(self, shard: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """A checkpoint tensor (global, interleaved) -> {split shard: its global rows}."""
        hk, hv, k, v = self.heads
        r = hv // hk
        if shard == "in_proj_qkvz":
            q, k_, v_, z = tensor.view(hk, -1, tensor.shape[-1]).split([k, k, r * v, r * v], 1)
            flat = [x.reshape(-1, tensor.shape[-1]) for x in (q, k_, v_, z)]
            return {"in_proj_qkv": torch.cat(flat[:3]), "in_proj_z": flat[3]}
        b, a = tensor.view(hk, 2 * r, tensor.shape[-1]).split([r, r], 1)
        return {"in_proj_b": b.reshape(hv, -1), "in_proj_a": a.reshape(hv, -1)}

    def load_weight(
        self, attr: str, tensor: torch.Tensor, shard: str | None, expert: int | None
    ) -> None:
        if attr != "weight" or shard not in self.checkpoint_shards:
            raise ValueError(f"unexpected GDN in_proj tensor {attr!r} (shard {shard!r})")
        for name, rows in self.deinterleave(shard, tensor).items():
            offset, size = self.shard_offsets[name]
            rows = self.tp_rules[("weight", name)].slice(rows, tp_rank(), tp_size())
            self.weight.data.narrow(0, offset, size).copy_(rows)


class InterleavedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's GDN layer: the same math as Qwen3.5's, its in_proj loaded from the
    per-key-head interleaved `in_proj_qkvz` / `in_proj_ba` (see InterleavedGDNInProj)."""

    def make_in_proj(self, hidden_size, shards, num_k_heads, num_v_heads, head_k_dim, head_v_dim):
        return InterleavedGDNInProj(
            hidden_size, shards, num_k_heads, num_v_heads, head_k_dim, head_v_dim
        )
