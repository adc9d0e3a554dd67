"""PyTorch reference of the `mla` op family: float32 math, any device (CPU included).

The oracle the fast MLA backends are tested against. It loops over sequences in Python with the
host copies of the batch layout, so it never syncs the device.
"""

from __future__ import annotations

import torch

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.mla import MLABackend


def write_latent(
    c_kv: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter rows `[c_kv | k_pe]` ([T, R], [T, P]) into `latent_cache` [num_blocks, block_size,
    R + P] at `slot_mapping` [T]; slot -1 skips its token (nothing changes for it)."""
    flat = latent_cache.view(-1, latent_cache.shape[-1])  # [num_blocks * block_size, R + P]
    new = torch.cat([c_kv, k_pe], dim=-1).to(latent_cache.dtype)  # [T, R + P]
    valid = slot_mapping >= 0  # [T]
    # NOTE: a skipped token is redirected to the first valid token's slot with that token's
    # value (identical bits), so no boolean indexing syncs the host; with no valid token, slot 0
    # is rewritten with its own contents
    first = torch.argmax(valid.to(torch.int32))
    any_valid = valid[first]
    slot0 = torch.zeros_like(slot_mapping[0])
    fallback_slot = torch.where(any_valid, slot_mapping[first], slot0)
    fallback_val = torch.where(any_valid, new[first], flat[0])  # [R + P]
    slots = torch.where(valid, slot_mapping, fallback_slot)  # [T]
    vals = torch.where(valid[:, None], new, fallback_val[None])  # [T, R + P]
    flat.index_copy_(0, slots, vals)


def gather_latent(latent_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """The first `seq_len` cached latents of one sequence: [seq_len, R + P] in float32."""
    block_size = latent_cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    rows = latent_cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, R + P]
    return rows.reshape(-1, latent_cache.shape[-1])[:seq_len].float()


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
        lat = gather_latent(latent_cache, block_tables[b], seq_len)  # [S, R + P]
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

    def forward(self, q_lat, q_pe, c_kv, k_pe, latent_cache, meta: BatchMetadata, scale: float):
        write_latent(c_kv, k_pe, latent_cache, meta.slot_mapping)
        return paged_mla(
            q_lat,
            q_pe,
            latent_cache,
            meta.query_start_loc_cpu,
            meta.seq_lens_cpu,
            meta.block_tables,
            scale,
        )
