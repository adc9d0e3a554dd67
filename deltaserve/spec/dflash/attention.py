"""Attention of a drafted block over its sequence's paged context plus the block itself.

The drafter's paged cache holds K / V of context positions only (0 .. ctx_len - 1 of each
sequence); the block's own K / V (positions ctx_len .. ctx_len + L - 1) are passed in and never
written. Visibility (z-lab's `_attention_mask`, over absolute positions, query position
qp = ctx_len + i, key position kp):

- every valid context key and every block key, unless
- causal: kp <= qp;
- sliding window W: qp - kp < W, and also kp - qp < W when not causal.

A query always sees its own key, so no row is empty.

`paged_block_attention` reads only device tensors with shapes fixed by (rows, block-table width,
L): no host sync, so it can run inside a CUDA graph of the block forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.spec.draft_kv import gather_context


def block_visibility(
    ctx_lens: torch.Tensor, num_ctx_keys: int, block_len: int, causal: bool, window: int | None
) -> torch.Tensor:
    """[R, L, num_ctx_keys + L] bool: query i of row r sees key j (keys: the first
    num_ctx_keys context slots, then the L block positions)."""
    device = ctx_lens.device
    lens = ctx_lens.long()[:, None]  # [R, 1]
    ctx_pos = torch.arange(num_ctx_keys, device=device)[None, :]  # [1, S]
    blk = torch.arange(block_len, device=device)[None, :]  # [1, L]
    key_pos = torch.cat([ctx_pos.expand(lens.shape[0], -1), lens + blk], dim=1)  # [R, S + L]
    key_ok = torch.cat(
        [ctx_pos < lens, torch.ones_like(blk, dtype=torch.bool).expand(lens.shape[0], -1)], dim=1
    )  # [R, S + L]
    q_pos = (lens + blk)[:, :, None]  # [R, L, 1]
    kp = key_pos[:, None, :]  # [R, 1, S + L]
    vis = key_ok[:, None, :].expand(-1, block_len, -1)  # [R, L, S + L]
    if causal:
        vis = vis & (kp <= q_pos)
    if window is not None:
        vis = vis & (q_pos - kp < window)
        if not causal:
            vis = vis & (kp - q_pos < window)
    return vis


def paged_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    """Attention of R rows' blocks over their paged context and the block.

    Args:
        q: [R * L, Hq, D] block queries, row r owning rows r * L .. r * L + L - 1.
        k, v: [R * L, Hkv, D] the block's keys / values (not cached).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] the layer's paged context K / V.
        block_tables: [R, nb] int block ids; nb * block_size must cover every row's ctx_len.
        ctx_lens: [R] int context positions cached per row (the block starts there).
        scale: softmax scale; causal / window: the layer's mask (module docstring).

    Returns:
        [R * L, Hq, D] in q's dtype.
    """
    R = block_tables.shape[0]
    T, Hq, D = q.shape
    L = T // R
    Hkv = k.shape[1]
    ck, cv = gather_context(k_cache, v_cache, block_tables, ctx_lens)  # [R, S, Hkv, D]
    S = ck.shape[1]
    keys = torch.cat([ck, k.reshape(R, L, Hkv, D).to(ck.dtype)], dim=1)  # [R, S + L, Hkv, D]
    values = torch.cat([cv, v.reshape(R, L, Hkv, D).to(cv.dtype)], dim=1)
    group = Hq // Hkv
    keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)  # [R, Hq, S + L, D]
    values = values.repeat_interleave(group, dim=2).transpose(1, 2)
    queries = q.reshape(R, L, Hq, D).transpose(1, 2).to(keys.dtype)  # [R, Hq, L, D]
    vis = block_visibility(ctx_lens, S, L, causal, window)[:, None]  # [R, 1, L, S + L]
    o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=vis, scale=scale)
    return o.transpose(1, 2).reshape(T, Hq, D).to(q.dtype)  # [R, L, Hq, D] -> [R * L, Hq, D]
