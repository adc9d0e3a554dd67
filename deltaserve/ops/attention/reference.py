"""PyTorch reference for paged attention: fp32 math, runs anywhere (CPU included).

This is the oracle the fast backends are tested against; it favours clarity over speed. It loops
over sequences in Python using the host copies of the batch layout, so it never syncs the device.
"""

from __future__ import annotations

import torch

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops.attention import AttentionBackend
from deltaserve.ops.attention.kv_writer import write_kv

__all__ = ["TorchAttentionBackend", "gather_kv", "paged_attention", "write_kv"]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` cached tokens of one sequence: [seq_len, Hkv, D] in float32."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    kv = cache[blocks]  # [num_blocks, block_size, Hkv, D]
    kv = kv.reshape(num_blocks * block_size, *cache.shape[2:])  # [num_blocks * block_size, Hkv, D]
    return kv[:seq_len].float()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc_cpu: list[int],
    seq_lens_cpu: list[int],
    block_tables: torch.Tensor,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of a ragged batch of queries over the paged KV cache (keys already written).

    Args:
        q: [T, Hq, D] queries; sequence b owns rows `query_start_loc_cpu[b] : [b + 1]`.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D]; Hq must be a multiple of Hkv.
        query_start_loc_cpu: B + 1 cumulative query lengths (host list).
        seq_lens_cpu: B context lengths after this step, cached + new (host list).
        block_tables: [B, max_blocks] int32 block ids per sequence.
        scale: softmax scale applied to q.k.
        causal: when True, query i of sequence b (at absolute position
            `seq_len - q_len + i`) sees keys 0 .. that position; otherwise all `seq_len` keys.

    Returns:
        [T, Hq, D] in q's dtype. Query head h reads kv head `h // (Hq // Hkv)`. Rows not owned
        by any sequence (padding past `query_start_loc_cpu[-1]`) are zero.
    """
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, f"Hq={num_q_heads} not a multiple of Hkv={num_kv_heads}"
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    for b, seq_len in enumerate(seq_lens_cpu):
        start, end = query_start_loc_cpu[b], query_start_loc_cpu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        assert context_len >= 0, f"sequence {b}: q_len {q_len} > seq_len {seq_len}"
        keys = gather_kv(k_cache, block_tables[b], seq_len)  # [S, Hkv, D]
        values = gather_kv(v_cache, block_tables[b], seq_len)  # [S, Hkv, D]
        keys = keys.repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = values.repeat_interleave(group, dim=1)  # [S, Hq, D]
        qf = q[start:end].float()  # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", qf, keys) * scale  # [Hq, L, S]
        if causal:
            q_pos = torch.arange(q_len, device=q.device)[:, None] + context_len  # [L, 1]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, S]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Hq, L, S]
        out[start:end] = torch.einsum("hls,shd->lhd", probs, values).to(q.dtype)
    return out


class TorchAttentionBackend(AttentionBackend):
    """Reference attention backend: `write_kv` then `paged_attention`, fp32 math, any device.

    Decode rows of q > 1 tokens need nothing special: `paged_attention` takes each row's query
    length from the host lists and places its queries at `seq_len - q_len + i`.
    """

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
        causal: bool = True,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc_cpu,
            meta.seq_lens_cpu,
            meta.block_tables,
            scale,
            causal,
        )
