"""MLA prefill in the expanded form: keys and values rebuilt from the latents, then ordinary
attention (PyTorch's scaled_dot_product_attention, which picks its fused kernels on the GPU).

The absorbed form (every `mla` backend) attends H query heads over one (R + P)-wide latent per
token: per (query, key) pair and head it costs R + P multiply-adds for the score and R for the
output (1,088 at DeepSeek-V2's R 512, P 64). Expanded, each head has its own keys
`[W_UK c | k_pe]` (N + P wide) and values `W_UV^T c` (V wide): N + P + V multiply-adds a pair
(320 at N 128, P 64, V 128), 3.4x fewer, for the cost of expanding each sequence's latents once
per step (S x R x H (N + V) multiply-adds and [H, S, 2 max(N + P, V)] of memory, transient,
one sequence at a time). Decode
(one query row per sequence) stays absorbed: there the latents' bytes decide, and expanding
would multiply them.

The three are padded with zero columns to one head size (the keys and values rebuilt through
zero-padded weights, so no copy pads them) and passed 4-d, so that PyTorch's fused kernels
(flash / memory-efficient) can serve them.

Same math as the absorbed reference (deltaserve.ops.mla.reference.paged_mla followed by
W_UV): score = scale * (q_nope . W_UK c + q_pe . k_pe), out = softmax @ (W_UV^T c).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from deltaserve.ops.attention.reference import gather_kv

# The most transient memory one sequence's expansion may take under DELTASERVE_MLA_PREFILL=auto
# (`expanded_bytes`; the layer runs a step absorbed rather than exceed it): within the 1 GiB of
# slack the cache planner keeps free beside the step's activations (cache/planner.py
# activation_reserve_bytes). At V2-Lite's 16 heads and 8192 queries: about 30k latents.
EXPANDED_MAX_BYTES = 512 * 2**20


def expanded_bytes(
    seq_len: int, query_len: int, heads: int, r: int, p: int, n: int, v: int, elt: int
) -> int:
    """An upper bound of the transient bytes `expanded_prefill` holds at once for one sequence
    of `seq_len` latents and `query_len` queries (element size `elt`): the gathered latents
    (and their cast, where the cache's dtype differs), the keys and values rebuilt at the
    padded head size, the padded queries and the output (the padded weights, [H, R, width]
    twice, are the call's, not the sequence's)."""
    width = max(n + p, v)
    return elt * (seq_len * (2 * (r + p) + heads * 2 * width) + heads * query_len * 2 * width)


def expanded_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    query_start_loc_cpu: list[int],
    seq_lens_cpu: list[int],
    block_tables: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal MLA of prefill rows over the paged latent cache, the step's latents already
    written (the layer runs a mixed step's decode rows absorbed and hands the prefill part
    here).

    Args:
        q_nope: [T, H, N]; q_pe: [T, H, P] (rotary applied); sequence b owns query rows
            `query_start_loc_cpu[b] : [b + 1]` and has `seq_lens_cpu[b]` latents after this
            step (its context first).
        latent_cache: [num_blocks, block_size, R + P]; block_tables [B, max_blocks].
        w_uk: [H, N, R]; w_uv: [H, R, V] (the halves of kv_b_proj, this rank's heads).
        scale: the softmax scale.

    Returns:
        [T, H, V] in q_nope's dtype; rows owned by no sequence are zero.
    """
    num_tokens, heads, n = q_nope.shape
    r, v_dim = w_uk.shape[-1], w_uv.shape[-1]
    width = max(n + q_pe.shape[-1], v_dim)  # one head size for q, k and v (the fused kernels')
    # W_UK^T and W_UV with zero columns up to the head size: c @ them gives keys (their rope
    # columns filled after) and values already padded, no copy of either
    w_k = w_uk.new_zeros(heads, r, width)
    w_k[..., :n] = w_uk.transpose(1, 2)
    w_v = w_uv.new_zeros(heads, r, width)
    w_v[..., :v_dim] = w_uv
    out = q_nope.new_zeros(num_tokens, heads, v_dim)
    starts = query_start_loc_cpu
    for b, seq_len in enumerate(seq_lens_cpu):
        start, end = starts[b], starts[b + 1]
        if end > start:  # one sequence at a time: its temporaries go before the next's
            o = _attend_one(
                q_nope[start:end], q_pe[start:end], latent_cache, block_tables[b], seq_len,
                w_k, w_v, scale,
            )  # fmt: skip
            out[start:end] = o[0, :, :, :v_dim].transpose(0, 1)  # [1, H, L, width] -> [L, H, V]
    return out


def _attend_one(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One sequence's L queries (q_nope [L, H, N], q_pe [L, H, P]) over its `seq_len` latents,
    with W_UK^T / W_UV zero-padded to the head size (w_k, w_v [H, R, width]) -> [1, H, L,
    width] (the columns past V zero): what `expanded_bytes` bounds."""
    q_len, heads, n = q_nope.shape
    p = q_pe.shape[-1]
    r, width = w_k.shape[1], w_k.shape[2]
    lat = gather_kv(latent_cache.unsqueeze(2), block_table, seq_len)[:, 0]  # [S, R + P]
    c = lat[:, :r].to(q_nope.dtype)  # [S, R]
    k = torch.matmul(c, w_k)  # [S, R] @ [H, R, width] -> [H, S, width]: [k_nope | 0 | 0]
    k[..., n : n + p] = lat[:, r:].to(q_nope.dtype)  # k_pe, shared by every head
    v = torch.matmul(c, w_v)  # [H, S, width]: [v | 0]
    q = q_nope.new_zeros(heads, q_len, width)  # [H, L, width]: [q_nope | q_pe | 0]
    q[..., :n] = q_nope.transpose(0, 1)
    q[..., n : n + p] = q_pe.transpose(0, 1)
    # [1, H, L | S, width]: PyTorch's fused attention kernels take 4-d inputs only (3-d ones
    # ran its unfused math: 8,888 tok/s at V2-Lite prefill 8192, docs/benchmarks.md)
    q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if q_len == seq_len:  # no context: plain causal (the flash kernels serve it)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    mask = causal_lower_right(q_len, seq_len)  # query i sees latents 0 .. context + i
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
