"""PyTorch reference of the `mla` op family: float32 math, any device (CPU included).

The oracle the fast MLA backends are tested against. It loops over sequences in Python with the
host copies of the batch layout, so it never syncs the device.
"""

from __future__ import annotations

import torch

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.attention.kv_writer import write_rows
from deltaserve.ops.attention.reference import gather_kv
from deltaserve.ops.mla import MLABackend


def write_latent(
    c_kv: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter rows `[c_kv | k_pe]` ([T, R], [T, P]) into `latent_cache` [num_blocks, block_size,
    R + P] at `slot_mapping` [T']; slot -1 skips its token (nothing changes for it); rows past T'
    are ignored. The paged-KV writer's scatter over a one-head view of the cache."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    new = torch.cat([c_kv[:num_tokens], k_pe[:num_tokens]], dim=-1)  # [T', R + P]
    # [num_blocks, block_size, 1, R + P] view and [T', 1, R + P] rows: one "head"
    write_rows(latent_cache.unsqueeze(2), new.unsqueeze(1), slot_mapping)


def paged_mla(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    query_start_loc_cpu: list[int],
    seq_lens_cpu: list[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal absorbed MLA of a ragged batch over the paged latent cache (latents written).

    q_lat [T, H, R], q_pe [T, H, P]; sequence b owns query rows `query_start_loc_cpu[b] : [b+1]`
    and has `seq_lens_cpu[b]` cached tokens after this step. Returns [T, H, R] in q_lat's dtype;
    rows owned by no sequence are zero.
    """
    r = q_lat.shape[-1]
    out = torch.zeros_like(q_lat)
    for b, seq_len in enumerate(seq_lens_cpu):
        start, end = query_start_loc_cpu[b], query_start_loc_cpu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        assert context_len >= 0, f"sequence {b}: q_len {q_len} > seq_len {seq_len}"
        lat = gather_kv(latent_cache.unsqueeze(2), block_tables[b], seq_len)[:, 0]  # [S, R + P]
        c, pe = lat[:, :r], lat[:, r:]  # [S, R], [S, P]
        scores = torch.einsum("lhr,sr->hls", q_lat[start:end].float(), c)
        scores = (scores + torch.einsum("lhp,sp->hls", q_pe[start:end].float(), pe)) * scale
        q_pos = torch.arange(q_len, device=q_lat.device)[:, None] + context_len  # [L, 1]
        k_pos = torch.arange(seq_len, device=q_lat.device)[None, :]  # [1, S]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))  # [H, L, S]
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hls,sr->lhr", probs, c).to(q_lat.dtype)
    return out


class TorchMLABackend(MLABackend):
    """Reference MLA backend: `write_latent` then `paged_mla`, float32 math, any device."""

    name = "torch"
    latent_writer = staticmethod(write_latent)
    decodes_alone = True

    def decode_rows(self, q_lat, q_pe, latent_cache, meta: BatchMetadata, scale: float):
        nd, nt = meta.num_decodes, meta.num_decode_tokens
        return paged_mla(
            q_lat[:nt],
            q_pe[:nt],
            latent_cache,
            meta.query_start_loc_cpu[: nd + 1],
            meta.seq_lens_cpu[:nd],
            meta.block_tables[:nd],
            scale,
        )

    def forward(self, q_lat, q_pe, c_kv, k_pe, latent_cache, meta: BatchMetadata, scale: float):
        self.write_latents(c_kv, k_pe, latent_cache, meta)
        return paged_mla(
            q_lat,
            q_pe,
            latent_cache,
            meta.query_start_loc_cpu,
            meta.seq_lens_cpu,
            meta.block_tables,
            scale,
        )
