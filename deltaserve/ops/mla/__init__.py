"""The `mla` op family: multi-head latent attention (DeepSeek-V2) over a paged latent cache.

MLA caches one compressed latent per token and layer, shared by all query heads:
`latent_cache` [num_blocks, block_size, R + P], each row `[c_kv (R = kv_lora_rank) | k_pe (P =
qk_rope_head_dim)]`, c_kv after `kv_a_layernorm`, k_pe after rotary. The layer (deltaserve.layers
.mla) absorbs W_UK (the key half of kv_b_proj) into the query, so every backend computes an MQA
of H query heads over one (R + P)-wide key per token:

    score[t, h, s] = scale * (q_lat[t, h] . c_kv[s] + q_pe[t, h] . k_pe[s])
    out[t, h]      = sum_s softmax_s(score[t, h, :]) * c_kv[s]            (latent space, [R])

and the layer applies W_UV (the value half of kv_b_proj) and o_proj to `out`. Query token i of
sequence b sits at absolute position `context_lens[b] + i` and sees cached tokens 0 .. that
position (causal), as for paged attention (deltaserve.ops.attention). Before attending, a backend
writes the step's new latents (`c_kv` [T, R], `k_pe` [T, P]) at `meta.slot_mapping` (-1: skip
the token), so a query sees its own token.

Backends (deltaserve.backends, layer kind "mla", only for models whose layers declare an
`MLASpec`): the torch reference (reference.py: float32 math, any device, loops over sequences
with the host lists) accepts everything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.planned_backend import PlannedBackend


def bmm_per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] @ w [H, K, N] per head -> [T, H, N] contiguous, through torch.bmm."""
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).contiguous()  # [H, T, N] -> [T, H, N]


def all_decode(meta: BatchMetadata) -> bool:
    """Whether every sequence of the step is a decode (the batch size from the static shape of
    `seq_lens`, as a CUDA-graph capture sees it)."""
    return meta.num_decodes >= meta.seq_lens.shape[0]


class MLABackend(PlannedBackend, ABC):
    """Writes a step's new latents into the paged latent cache and attends over it.

    Shapes: q_lat [T, H, R] (q_nope @ W_UK per head), q_pe [T, H, P] (rotary applied), c_kv
    [T, R], k_pe [T, P] (rotary applied), latent_cache [num_blocks, block_size, R + P]. Returns
    [T, H, R] in q_lat's dtype (rows past `meta.query_start_loc_cpu[-1]`, padding: zero or
    anything finite). Decode rows: as `AttentionBackend` (the first `meta.num_decodes` sequences
    carry `meta.decode_query_len` tokens each).

    The lifecycle hooks (`setup` with the `MLASpec`s, `init_cuda_graph`, `plan_graph`, `plan`)
    are `PlannedBackend`'s, as for attention backends.
    """

    # Under DELTASERVE_MLA_PREFILL=auto (the default) a step whose longest prefill query has
    # at least this many tokens runs its prefill rows in the expanded form
    # (deltaserve.ops.mla.expanded) instead of this backend's prefill; None: never (a backend
    # whose prefill was not measured against it)
    expanded_min_query: int | None = None
    # whether `decode_rows` serves (then a mixed step's prefill rows may run expanded beside
    # its decode rows; else only prefill-only steps expand)
    decodes_alone: bool = False

    @abstractmethod
    def forward(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
    ) -> torch.Tensor: ...

    def forward_out(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """`forward`, then the layer's per-head W_UV product ([T, H, R] @ w_uv [H, R, V] ->
        [T, H, V]): `head_matmul` after `forward` here; the Triton decode may join the product
        to its split merge (DELTASERVE_MLA_MERGE=fused)."""
        out = self.forward(q_lat, q_pe, c_kv, k_pe, latent_cache, meta, scale)
        return self.head_matmul(out, w_uv)

    def decode_rows(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
    ) -> torch.Tensor:
        """A mixed step's decode rows alone, absorbed, the step's latents already written:
        q_lat [>= nd * q, H, R] / q_pe (rows 0 .. nd * q - 1 are the decode rows) ->
        [nd * q, H, R]. Backends with `decodes_alone` implement it; the layer runs the prefill
        rows beside it in the expanded form."""
        raise NotImplementedError(f"the {self.name} mla backend attends no decode rows alone")

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, H, K] @ w [H, K, N] per head -> [T, H, N] contiguous: the layer's absorbed
        projections (q_nope W_UK, out W_UV). `bmm_per_head` here; the CUDA backends run
        triton_head_matmul for decode-sized steps."""
        return bmm_per_head(x, w)

    def prep(
        self,
        fused,  # noqa: ANN001 (the step's FusedOps: its mla_rope_norm)
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_a: torch.Tensor,
        weight: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float,
        w_uk: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's step preparation: (q_pe rotated [T, H, P], latent [T, R + P] =
        [kv_a_layernorm(c_kv) | rotated k_pe], q_lat = q_nope @ W_UK [T, H, R]) from q_nope
        [T, H, N], q_pe [T, H, P] (strided views of q), kv_a [T, R + P], kv_a_layernorm's
        weight, cos / sin [T, P / 2] float32. Here `fused.mla_rope_norm` then `head_matmul`;
        the CUDA backends run both in one launch for decode-sized steps."""
        q_pe, latent = fused.mla_rope_norm(q_pe, kv_a, weight, cos, sin, eps)
        return q_pe, latent, self.head_matmul(q_nope, w_uk)

    # (c_kv, k_pe, latent_cache, slot_mapping) -> None: the scatter `forward` starts with
    # (reference.write_latent, or the Triton twin triton_writer.store_latent)
    latent_writer: Callable[..., None]

    def write_latents(
        self,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: BatchMetadata,
    ) -> None:
        """Write the step's latents (what `forward` does first) with the backend's
        `latent_writer`: `forward` itself, and a layer that then attends by other means
        (deltaserve.ops.mla.expanded)."""
        self.latent_writer(c_kv, k_pe, latent_cache, meta.slot_mapping)
