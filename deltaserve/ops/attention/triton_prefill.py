"""Paged attention prefill in Triton for ragged batches (decodes, prefill chunks, or a mix).

Sequence b has `q_len` new tokens on top of `seq_len - q_len` cached ones; all its keys are in
the paged cache already. A program takes BLOCK_Q = BLOCK_M // GROUP query tokens of one sequence
and all GROUP query heads of one KV head, flattened into BLOCK_M rows (row r is token r // GROUP,
head r % GROUP; the last BLOCK_M % GROUP rows idle), so each K / V tile is read once per group
and a group of 5 wastes 3 rows of 128 rather than 3 of 8. Flash-attention style over tiles of
BLOCK_N keys gathered through the block table, online softmax in float32, both products with
tl.dot. Causal: query i at absolute position `context_len + i` sees keys 0 .. that position;
non-causal: every query sees all `seq_len` keys. Key tiles that every row of the program sees
in full run without masks; only the diagonal and the tail are masked.

Grid: (T // BLOCK_Q + B, Hkv). Sequence b's query tiles are programs
`query_start_loc[b] // BLOCK_Q + b ..`; a program finds its sequence by binary search over
`query_start_loc` and exits when its tile is past the sequence's queries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops.attention.triton_decode import dot_dtype_flags, interpreting
from deltaserve.ops.specialize import STEP_INTS, TABLE_ARGS


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start, k_head, v_head, bt_row, q_pos, kv_end, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N tile of keys at `start` into the running softmax of q [BLOCK_M, D]."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = start + offs_n  # [BLOCK_N] key positions
    if MASKED:
        mask_n = pos < kv_end
        block = tl.load(bt_row + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + pos // PAGE).to(tl.int64)
    slot = pos % PAGE
    k_ptrs = k_head + (block * stride_kb + slot * stride_kt)[:, None] + offs_d[None, :]
    v_ptrs = v_head + (block * stride_vb + slot * stride_vt)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=mask_n[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=TABLE_ARGS)
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [T, Hq, D]
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q tokens x GROUP heads, padded
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP  # query tokens per program

    # the last sequence b whose first tile `query_start_loc[b] // BLOCK_Q + b` is <= pid
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = (first_tile <= pid).to(tl.int32)
        lo = lo + go_right * (mid - lo)
        hi = mid - 1 + go_right * (hi - mid + 1)
    b = lo
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    num_q_tiles = tl.cdiv(q_len, BLOCK_Q)
    local = pid - (q_start // BLOCK_Q + b)
    if local >= num_q_tiles:
        return
    tile = num_q_tiles - 1 - local  # the longest (last) query tiles start first
    seq_len = tl.load(seq_lens_ptr + b)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] query index within the sequence
    g = offs_m % GROUP
    mask_m = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    heads = kvh * GROUP + g  # [BLOCK_M]
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None],
        other=0.0,
    )  # [BLOCK_M, D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + tok  # [BLOCK_M] absolute query positions

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kvh.to(tl.int64) * stride_vh
    if CAUSAL:
        kv_end = context_len + tl.minimum((tile + 1) * BLOCK_Q, q_len)
        full_end = (context_len + tile * BLOCK_Q + 1) // BLOCK_N * BLOCK_N  # seen by every row
    else:
        kv_end = seq_len
        full_end = seq_len // BLOCK_N * BLOCK_N
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a runtime bound
        start = 0
        while start < full_end:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, k_head, v_head, bt_row, q_pos, kv_end, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt,
                HEAD_DIM, PAGE, BLOCK_N, False, CAUSAL, UPCAST, PRECISION,
            )  # fmt: skip
            start += BLOCK_N
        while start < kv_end:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, k_head, v_head, bt_row, q_pos, kv_end, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt,
                HEAD_DIM, PAGE, BLOCK_N, True, CAUSAL, UPCAST, PRECISION,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in tl.range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, k_head, v_head, bt_row, q_pos, kv_end, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt,
                HEAD_DIM, PAGE, BLOCK_N, False, CAUSAL, UPCAST, PRECISION,
            )  # fmt: skip
        for start in tl.range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, start, k_head, v_head, bt_row, q_pos, kv_end, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt,
                HEAD_DIM, PAGE, BLOCK_N, True, CAUSAL, UPCAST, PRECISION,
            )  # fmt: skip

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def prefill_config(group: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes and warps (static in the shapes); BLOCK_M rows hold BLOCK_M // group tokens."""
    if interpreting():
        block_m, block_n, warps, stages = 32, 16, 4, 1
    elif dtype == torch.float32:
        block_m, block_n, warps, stages = 32 if head_dim >= 256 else 64, 32, 4, 2
    elif head_dim >= 256:  # H200, 8192 causal tokens, 16 / 4 heads: 444 TFLOP/s
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:  # H200, 8192 causal tokens, 40 / 8 heads of 128: 359 TFLOP/s
        block_m, block_n, warps, stages = 128, 64, 4, 3
    block_m = max(block_m, triton.next_power_of_2(group))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    causal: bool = True,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Attention of a ragged batch of queries over the paged cache (keys already written).

    Args:
        q: [T, Hq, D]; sequence b owns rows `query_start_loc[b] : query_start_loc[b + 1]`.
            Rows past `query_start_loc[-1]` come back as zeros (untouched in a given `out`).
        k_cache, v_cache: [num_blocks, page, Hkv, D].
        query_start_loc: [B + 1] int32; seq_lens: [B] int32 (cached + new keys).
        block_tables: [B, max_blocks] int32.
        scale: softmax scale; causal: see the module docstring.
        out: optional [T, Hq, D] destination; config: overrides of `prefill_config`.

    Returns:
        [T, Hq, D] in q's dtype.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    assert num_q_heads == group * num_kv_heads
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = torch.zeros_like(q)  # rows owned by no sequence stay zero
    if batch == 0 or num_tokens == 0:
        return out
    cfg = prefill_config(group, head_dim, k_cache.dtype)
    cfg.update(config or {})
    upcast, precision = dot_dtype_flags(k_cache.dtype)
    grid = (num_tokens // (cfg["BLOCK_M"] // group) + batch, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * 1.4426950408889634, batch,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, CAUSAL=causal, UPCAST=upcast,
        PRECISION=precision, INTERPRET=interpreting(), **cfg,
    )  # fmt: skip
    return out
