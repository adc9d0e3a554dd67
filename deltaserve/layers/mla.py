"""Multi-head latent attention (DeepSeek-V2), absorbed, over a paged latent cache.

Per token (HF's modeling_deepseek_v2 `DeepseekV2Attention`):
- q = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with a q LoRA; per head
  `[q_nope (N = qk_nope_head_dim) | q_pe (P = qk_rope_head_dim)]`;
- kv_a_proj_with_mqa(x) = `[c_kv (R = kv_lora_rank) | k_pe (P)]`, c_kv through kv_a_layernorm;
  k_pe is one rope key shared by every head;
- q_pe and k_pe rotated (interleaved pairs, YaRN; deltaserve.layers.yarn);
- kv_b_proj (rows per head `[k_nope (N) | v (V = v_head_dim)]`) expands c_kv to keys and values.

Absorbed form (what the engine runs by default): W_UK [H, N, R] and W_UV [H, R, V] are the two
halves of kv_b_proj per head, so q_nope . k_nope = (q_nope @ W_UK) . c_kv, and attention over
values is (softmax @ c_kv) @ W_UV. The layer computes q_lat = q_nope @ W_UK, hands the `mla` op
(deltaserve.ops.mla) q_lat, q_pe and the step's c_kv / k_pe (which it writes into the paged
`latent_cache` [blocks, block_size, R + P]), and applies W_UV and o_proj to the op's [T, H, R].
The two halves are prepared once after loading (`process_weights_after_loading`), and
kv_b_proj's checkpoint tensor is what fills them. A step's prefill rows may instead attend with
keys and values rebuilt from the latents (deltaserve.ops.mla.expanded: 3.4x fewer multiply-adds
per pair at DeepSeek-V2's widths, plus the rebuilding): always under
DELTASERVE_MLA_PREFILL=expanded; under `auto` (the default) when the step's longest prefill query
has at least the `mla` backend's `expanded_min_query` tokens (measured: 4096 on triton, 6144
on split) and every prefill sequence's expansion fits EXPANDED_MAX_BYTES (`expands`). Decode
rows always run absorbed: in a mixed step beside the expanded prefill rows where the backend
attends them alone (`decode_rows`), else the whole step absorbed.

Both projections that read x are one GEMM (`fused_qkv_a_proj`: [q_proj or q_a_proj |
kv_a_proj_with_mqa]). Tensor parallelism: heads are split (q_proj / q_b_proj and kv_b_proj by
heads, o_proj row-parallel); the latent path (q_a_proj, kv_a_proj_with_mqa, both norms) is
replicated, so every rank caches the whole latent.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve import env
from deltaserve.cache.spec import MLASpec
from deltaserve.distributed.parallel_state import tp_size
from deltaserve.distributed.sharding import divide
from deltaserve.forward_context import ForwardContext
from deltaserve.layers.norms import RMSNorm
from deltaserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from deltaserve.layers.yarn import InterleavedRotary, interleaved_cos_sin
from deltaserve.ops.mla import all_decode, bmm_per_head
from deltaserve.ops.mla import expanded as mla_expanded
from deltaserve.ops.mla.expanded import expanded_prefill

# NOTE: HF builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not
# config.rms_norm_eps
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Latent attention over this rank's heads (global `num_heads`; each rank takes an even
    share). Called as `mixer(positions, x, ctx)`; caches an `MLASpec` latent."""

    partial_output = "o_proj"  # parallel_linear.leave_output_partial
    normed_input_projection = "fused_qkv_a_proj"  # decoder.normed_input

    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rotary: InterleavedRotary,
        softmax_scale: float,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = divide(num_heads, tp_size(), "num_attention_heads", "MLA query heads")
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim = qk_nope_head_dim
        self.rope_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        latent = kv_lora_rank + qk_rope_head_dim
        if q_lora_rank is None:
            shards = {"q_proj": num_heads * qk_dim, "kv_a_proj_with_mqa": latent}
            replicated: tuple[str, ...] = ("kv_a_proj_with_mqa",)
        else:
            shards = {"q_a_proj": q_lora_rank, "kv_a_proj_with_mqa": latent}
            replicated = ("q_a_proj", "kv_a_proj_with_mqa")
        self.fused_qkv_a_proj = ColumnParallelLinear(hidden_size, shards, replicated=replicated)
        if q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, {"q_b_proj": num_heads * qk_dim})
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        # rows per head [k_nope | v]; split by heads. Emptied into w_uk / w_uv after loading.
        self.kv_b_proj: ColumnParallelLinear | None = ColumnParallelLinear(
            kv_lora_rank, {"kv_b_proj": num_heads * (qk_nope_head_dim + v_head_dim)}
        )
        self.w_uk: nn.Parameter | None = None  # [H, N, R] (this rank's heads)
        self.w_uv: nn.Parameter | None = None  # [H, R, V]
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size)
        self.rotary = rotary
        self.scale = softmax_scale
        self.prefill_mode = env.mla_prefill()  # auto | absorbed | expanded

    @property
    def cache_spec(self) -> MLASpec:
        """What this layer caches: one [R + P] latent per token (this rank's heads attend it)."""
        return MLASpec(self.num_heads, self.kv_lora_rank, self.rope_dim)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj [H * (N + V), R] into W_UK [H, N, R] and W_UV^T [H, R, V] (contiguous,
        ready for batched matmuls) and drop kv_b_proj (the halves replace it; same bytes)."""
        if self.kv_b_proj is None:
            return
        w = self.kv_b_proj.weight.detach()  # [H * (N + V), R]
        w = w.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk = w[:, : self.nope_dim].contiguous()  # [H, N, R]
        w_uv = w[:, self.nope_dim :].transpose(1, 2).contiguous()  # [H, R, V]
        self.kv_b_proj = None
        self.w_uk = nn.Parameter(w_uk, requires_grad=False)
        self.w_uv = nn.Parameter(w_uv, requires_grad=False)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes the step's latents into its cache (of the first
        `ctx.token_rows(T)` rows: the rest are padding, their output zero)."""
        parts = self.pre(positions, x, ctx)
        return self.post(self.core(parts, ctx), parts, ctx)

    # ---- the three pieces of a forward (engine/piecewise_graphs.py replays pre and post
    # from CUDA graphs over every row, and runs core eagerly over the step's tokens) ----------
    def pre(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, ...]:
        """x [rows, hidden] -> (q_nope [rows, H, N], rotated q_pe [rows, H, P], latent
        [rows, R + P] = [norm(c_kv) | rotated k_pe], q_lat = q_nope W_UK [rows, H, R]); per
        row, reads no batch layout."""
        if self.w_uk is None:
            raise RuntimeError("MLAttention ran before process_weights_after_loading")
        T, H, N = x.shape[0], self.num_heads, self.nope_dim
        ops = ctx.kernels.fused
        q_or_qa, kv_a = self.fused_qkv_a_proj.split(self.fused_qkv_a_proj(x))
        if self.q_lora_rank is not None:
            n = self.q_a_layernorm
            q = self.q_b_proj(ops.rms_norm(q_or_qa.contiguous(), n.weight, n.eps, False))
        else:
            q = q_or_qa
        q = q.reshape(T, H, N + self.rope_dim)  # per head [nope | rope]
        q_nope, q_pe = q[..., :N], q[..., N:]
        n = self.kv_a_layernorm
        cos, sin = interleaved_cos_sin(self.rotary, positions, ctx)
        # q_pe rotated (into a contiguous [T, H, P]), latent [T, R + P] = [norm(c_kv) | rotated
        # k_pe] and q_lat = q_nope W_UK ([T, H, N] @ [H, N, R] -> [T, H, R]): the mla backend's
        # preparation (one launch on the CUDA backends at decode sizes)
        if ctx.kernels.mla is None:
            q_pe, latent = ops.mla_rope_norm(q_pe, kv_a, n.weight, cos, sin, n.eps)
            return q_nope, q_pe, latent, bmm_per_head(q_nope, self.w_uk)
        q_pe, latent, q_lat = ctx.kernels.mla.prep(
            ops, q_nope, q_pe, kv_a, n.weight, cos, sin, n.eps, self.w_uk
        )
        return q_nope, q_pe, latent, q_lat

    def expands(self, ctx: ForwardContext) -> bool:
        """Whether this step's prefill rows attend in the expanded form: under
        DELTASERVE_MLA_PREFILL=expanded every step with prefill rows, under `auto` those whose
        longest prefill query has at least the backend's `expanded_min_query` tokens and whose
        every prefill sequence expands within EXPANDED_MAX_BYTES of transient memory
        (`expanded_bytes`: long contexts stay absorbed); a mixed step only where the backend
        attends its decode rows alone (`decodes_alone`). From host ints only: every TP rank
        decides the same."""
        meta, mla = ctx.meta, ctx.kernels.mla
        if self.prefill_mode == "absorbed" or all_decode(meta):
            return False
        if meta.num_decodes and not mla.decodes_alone:
            return False
        if self.prefill_mode == "expanded":
            return True
        if mla.expanded_min_query is None:
            return False
        pre = meta.prefill_part()  # its query lengths; seq_lens_cpu[nd:] its latents
        if pre.max_query_len < mla.expanded_min_query:
            return False
        elt = ctx.caches[self.layer_idx]["latent_cache"].element_size()
        qsl = pre.query_start_loc_cpu
        return all(
            mla_expanded.expanded_bytes(
                seq_len, qsl[i + 1] - qsl[i], self.num_heads, self.kv_lora_rank,
                self.rope_dim, self.nope_dim, self.v_head_dim, elt,
            ) <= mla_expanded.EXPANDED_MAX_BYTES
            for i, seq_len in enumerate(meta.seq_lens_cpu[meta.num_decodes :])
        )  # fmt: skip

    def _expanded(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        q_lat: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        tokens: int,
        cache: dict[str, torch.Tensor],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """`core` for a step that `expands`: the latents written, the prefill rows (after the
        decode rows) in the expanded form, the decode rows (if any) absorbed through the
        backend's `decode_rows` then W_UV -> [tokens, H, V]."""
        meta, mla = ctx.meta, ctx.kernels.mla
        latents = cache["latent_cache"]
        mla.write_latents(c_kv[:tokens], k_pe[:tokens], latents, meta)
        nd, nt = meta.num_decodes, meta.num_decode_tokens
        pre = meta.prefill_part()  # the prefill sequences; their rows start at nt
        out = expanded_prefill(
            q_nope[nt:tokens],
            q_pe[nt:tokens],
            latents,
            pre.query_start_loc_cpu,
            meta.seq_lens_cpu[nd:],
            meta.block_tables[nd:],
            self.w_uk,
            self.w_uv,
            self.scale,
        )  # [tokens - nt, H, V]
        if nt == 0:
            return out
        decoded = mla.decode_rows(q_lat, q_pe, latents, meta, self.scale)  # [nt, H, R]
        return torch.cat([mla.head_matmul(decoded, self.w_uv), out])  # [tokens, H, V]

    def core_out_shape(self) -> tuple[int, ...]:
        """The trailing dims of `core`'s output: [T, H, V]."""
        return (self.num_heads, self.v_head_dim)

    def core(self, parts: tuple[torch.Tensor, ...], ctx: ForwardContext) -> torch.Tensor:
        """`pre`'s output -> the attention output per head [tokens, H, V] of the step's
        `ctx.token_rows(rows)` tokens, their latents written to the cache first: absorbed
        (attention over the latents, then W_UV), or with keys and values expanded from the
        latents for the prefill rows of steps that `expands`."""
        if ctx.kernels.mla is None:
            raise RuntimeError("an MLA layer ran without an mla backend (Kernels.mla is None)")
        q_nope, q_pe, latent, q_lat = parts
        R = self.kv_lora_rank
        c_kv, k_pe = latent[:, :R], latent[:, R:]  # [rows, R], [rows, P]
        tokens = ctx.token_rows(latent.shape[0])  # the kernels see the step's tokens only
        cache = ctx.caches[self.layer_idx]
        if self.expands(ctx):  # steps with prefill rows (never a graph)
            return self._expanded(q_nope, q_pe, q_lat, c_kv, k_pe, tokens, cache, ctx)
        # attention in latent space [tokens, H, R], then @ W_UV [H, R, V] -> [tokens, H, V]
        return ctx.kernels.mla.forward_out(
            q_lat[:tokens],
            q_pe[:tokens],
            c_kv[:tokens],
            k_pe[:tokens],
            cache["latent_cache"],
            ctx.meta,
            self.scale,
            self.w_uv,
        )

    def post(
        self, o: torch.Tensor, parts: tuple[torch.Tensor, ...], ctx: ForwardContext
    ) -> torch.Tensor:
        """`core`'s output o [tokens, H, V] (tokens <= rows: the padded rows' output is zero)
        -> [rows, hidden]: o_proj."""
        rows = parts[0].shape[0]
        return self.o_proj(ctx.pad_rows(o, rows).reshape(rows, self.num_heads * self.v_head_dim))
