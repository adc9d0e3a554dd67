"""The torch paged-attention reference against dense naive attention, per sequence."""

from __future__ import annotations

import math

import pytest
import torch
from meta_helpers import make_meta, rel_err

from deltaserve.ops.attention.reference import TorchAttentionBackend, paged_attention, write_kv

# (context_len, q_len): two decodes first, then prefills (one with no prefix, one token alone,
# two on top of a cached prefix). Sequence lengths 7, 33, 1, 7, 13, 33.
SEQS = [(6, 1), (32, 1), (0, 1), (0, 7), (6, 7), (20, 13)]
NUM_DECODES = 2


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float, causal: bool
) -> torch.Tensor:
    """Dense attention of one sequence in float64: q [L, Hq, D], k and v [S, Hkv, D]."""
    q_len, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_q_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = (q[:, h].double() @ kh.T) * scale  # [L, S]
        if causal:
            for i in range(q_len):
                scores[i, context_len + i + 1 :] = float("-inf")
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


def build_case(
    seqs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
):
    """Paged cache (blocks handed out in random order, the rest NaN) holding each sequence's
    prefix, plus the step's new q / k / v and its metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil((c + q) / block_size) for c, q in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)

    block_tables, slot_mapping, full_k, full_v, qs, ks, vs = [], [], [], [], [], [], []
    for (context_len, q_len), n in zip(seqs, blocks_per_seq, strict=True):
        table, perm = perm[:n], perm[n:]
        block_tables.append(table)
        seq_len = context_len + q_len
        k_all = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_all = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(context_len):  # the cached prefix, written by hand
            k_cache[table[pos // block_size], pos % block_size] = k_all[pos]
            v_cache[table[pos // block_size], pos % block_size] = v_all[pos]
        for pos in range(context_len, seq_len):
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        full_k.append(k_all)
        full_v.append(v_all)
        qs.append(torch.randn(q_len, num_q_heads, head_dim, generator=gen).to(dtype))
        ks.append(k_all[context_len:])
        vs.append(v_all[context_len:])
    meta = make_meta(
        [q for _, q in seqs],
        [c for c, _ in seqs],
        NUM_DECODES,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
    )
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    return q, k, v, k_cache, v_cache, meta, full_k, full_v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [8, 16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (6, 2), (10, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_dense(block_size, num_q_heads, num_kv_heads, head_dim, causal):
    q, k, v, k_cache, v_cache, meta, full_k, full_v = build_case(
        SEQS, num_q_heads, num_kv_heads, head_dim, block_size, torch.float32
    )
    scale = head_dim**-0.5
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale, causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    for b, (context_len, _) in enumerate(SEQS):
        rows = slice(meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1])
        want = naive_attention(q[rows], full_k[b], full_v[b], context_len, scale, causal)
        assert rel_err(out[rows], want) < 1e-5, f"sequence {b}"
    # the new tokens landed where slot_mapping says; every other slot is still NaN
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[meta.slot_mapping], k, rtol=0, atol=0)
    num_written = sum(c + q for c, q in SEQS)
    assert torch.isnan(flat_k[:, 0, 0]).sum().item() == flat_k.shape[0] - num_written


def test_causal_and_non_causal_differ():
    """Guards the mask itself: a prefill row must change when it may see future keys."""
    q, k, v, k_cache, v_cache, meta, _, _ = build_case(SEQS, 4, 2, 8, 4, torch.float32)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    layout = (meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_tables, 0.3)
    causal = paged_attention(q, k_cache, v_cache, *layout, causal=True)
    full = paged_attention(q, k_cache, v_cache, *layout, causal=False)
    # a decode's query is the last position, so the mask changes nothing for it
    torch.testing.assert_close(causal[:NUM_DECODES], full[:NUM_DECODES], rtol=0, atol=0)
    assert rel_err(causal[NUM_DECODES:], full[NUM_DECODES:]) > 1e-2


def test_bf16_matches_dense():
    q, k, v, k_cache, v_cache, meta, full_k, full_v = build_case(
        SEQS, 6, 2, 16, 16, torch.bfloat16, seed=1
    )
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.25, True)
    assert out.dtype == torch.bfloat16
    for b, (context_len, _) in enumerate(SEQS):
        rows = slice(meta.query_start_loc_cpu[b], meta.query_start_loc_cpu[b + 1])
        want = naive_attention(q[rows], full_k[b], full_v[b], context_len, 0.25, True)
        assert rel_err(out[rows], want) < 1e-2, f"sequence {b}"


@pytest.mark.parametrize(
    "slot_mapping",
    [
        [-1, 0, 5, -1, 9, 2, -1],  # skipped tokens first, middle and last; slot 0 written
        [3, -1, -1, 0],
        [5, 0, -1],  # a skipped token after slot 0's writer must not clobber it
        [-1, 4],
        [-1, -1, -1],  # nothing to write at all
        [7],
    ],
)
def test_write_kv_skips_minus_one(slot_mapping):
    num_blocks, block_size, heads, dim = 3, 4, 2, 8
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen)
    k_cache[0, 0, 0, 0] = float("nan")  # slot 0's contents must survive bit for bit
    v_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen)
    k = torch.randn(len(slot_mapping), heads, dim, generator=gen)
    v = torch.randn(len(slot_mapping), heads, dim, generator=gen)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slot_mapping):
        if slot >= 0:
            want_k[slot // block_size, slot % block_size] = k[i]
            want_v[slot // block_size, slot % block_size] = v[i]
    write_kv(k, v, k_cache, v_cache, torch.tensor(slot_mapping, dtype=torch.int64))
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)


def test_padding_rows_are_skipped():
    """Rows past the last sequence (CUDA-graph padding, slot -1) write nothing and return 0."""
    q, k, v, k_cache, v_cache, meta, full_k, full_v = build_case(SEQS, 6, 2, 8, 4, torch.float32)
    num_pad = 3
    pad = torch.randn(num_pad, *k.shape[1:])
    q_pad = torch.cat([q, torch.randn(num_pad, *q.shape[1:])])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((num_pad,), -1)])
    nan_before = torch.isnan(k_cache).sum().item()
    out = TorchAttentionBackend().forward(
        q_pad, torch.cat([k, pad]), torch.cat([v, pad]), k_cache, v_cache, meta, 0.3
    )
    assert torch.isnan(k_cache).sum().item() == nan_before - k.numel()
    assert torch.count_nonzero(out[-num_pad:]) == 0
    last = len(SEQS) - 1
    rows = slice(meta.query_start_loc_cpu[last], meta.query_start_loc_cpu[last + 1])
    want = naive_attention(q[rows], full_k[last], full_v[last], SEQS[last][0], 0.3, True)
    assert rel_err(out[rows], want) < 1e-5
