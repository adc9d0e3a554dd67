"""MLA prefill in the expanded form: keys and values rebuilt from the latents, then ordinary
attention (PyTorch's scaled_dot_product_attention, which picks its fused kernels on the GPU).

The absorbed form (every `mla` backend) attends H query heads over one (R + P)-wide latent per
token: per (query, key) pair and head it costs R + P multiply-adds for the score and R for the
output (1,088 at DeepSeek-V2's R 512, P 64). Expanded, each head has its own keys
`[W_UK c | k_pe]` (N + P wide) and values `W_UV^T c` (V wide): N + P + V multiply-adds a pair
(320 at N 128, P 64, V 128), 3.4x fewer, for the cost of expanding each sequence's latents once
per step (S x R x H (N + V) multiply-adds and [S, H, N + P + V] of memory, transient). Decode
(one query row per sequence) stays absorbed: there the latents' bytes decide, and expanding
would multiply them.

The three are padded with zero columns to one head size and passed 4-d, so that PyTorch's fused
kernels (flash / memory-efficient) can serve them.

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
# activation_reserve_bytes). At V2-Lite's 16 heads: about 20k latents.
EXPANDED_MAX_BYTES = 512 * 2**20


def expanded_bytes(
    seq_len: int, query_len: int, heads: int, r: int, p: int, n: int, v: int, elt: int
) -> int:
    """An upper bound of the transient bytes `expanded_prefill` holds at once for one sequence
    of `seq_len` latents and `query_len` queries (element size `elt`): the gathered latents
    and their casts, the rebuilt keys (before and after the rope columns and the padding), the
    values (before and after the padding), the padded queries and the output."""
    width = max(n + p, v)
    per_latent = 2 * (r + p) + heads * (n + (n + p) + width + v + width)
    return elt * (seq_len * per_latent + heads * query_len * 3 * width)


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
    num_tokens, heads, _ = q_nope.shape
    out = q_nope.new_zeros(num_tokens, heads, w_uv.shape[-1])
    starts = query_start_loc_cpu
    for b, seq_len in enumerate(seq_lens_cpu):
        start, end = starts[b], starts[b + 1]
        if end > start:  # one sequence at a time: its temporaries go before the next's
            out[start:end] = _attend_one(
                q_nope[start:end], q_pe[start:end], latent_cache, block_tables[b], seq_len,
                w_uk, w_uv, scale,
            )  # fmt: skip
    return out


def _attend_one(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One sequence's L queries (q_nope [L, H, N], q_pe [L, H, P]) over its `seq_len` latents
    -> [L, H, V]: what `expanded_bytes` bounds."""
    q_len, heads, _ = q_nope.shape
    r, v_dim = w_uk.shape[-1], w_uv.shape[-1]
    qk_dim = q_nope.shape[-1] + q_pe.shape[-1]
    width = max(qk_dim, v_dim)  # one head size for all three (the fused kernels' condition)
    lat = gather_kv(latent_cache.unsqueeze(2), block_table, seq_len)[:, 0]
    c, k_pe = lat[:, :r].to(q_nope.dtype), lat[:, r:].to(q_nope.dtype)  # [S, R], [S, P]
    k_nope = torch.matmul(c, w_uk.transpose(1, 2))  # [S, R] @ [H, R, N] -> [H, S, N]
    k = torch.cat([k_nope, k_pe.expand(heads, seq_len, k_pe.shape[-1])], dim=-1)
    v = torch.matmul(c, w_uv)  # [S, R] @ [H, R, V] -> [H, S, V]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, L, N + P]
    # zero columns pad q / k or v to one head size: scores and outputs unchanged
    q, k = F.pad(q, (0, width - qk_dim)), F.pad(k, (0, width - qk_dim))
    v = F.pad(v, (0, width - v_dim))
    # [1, H, L | S, width]: PyTorch's fused attention kernels take 4-d inputs only (3-d ones
    # ran its unfused math: 8,888 tok/s at V2-Lite prefill 8192, docs/benchmarks.md)
    q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if q_len == seq_len:  # no context: plain causal (the flash kernels serve it)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:  # query i sees latents 0 .. context + i
        mask = causal_lower_right(q_len, seq_len)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o[0, :, :, :v_dim].transpose(0, 1)  # [1, H, L, width] -> [L, H, V]
