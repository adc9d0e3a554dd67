"""Paged attention decode in Triton: QLEN query tokens per sequence (1, or 1 + k drafts when
verifying), split-KV (flash-decoding).

Grid (batch, kv_head, num_splits). A program attends all query heads of one KV head's GQA group
for all QLEN tokens of the row at once over a contiguous range of the sequence's tokens, so each
K / V tile is read once per group and row: the QLEN x GROUP query rows (token-major) are padded
to a power of two >= 16 (for `tl.dot`) and masked. Query token t of a row (rows are token rows
b * QLEN + t of q) is causal: it sees keys 0 .. seq_len - QLEN + t.
Tiles of BLOCK_N tokens are gathered across pages through the block table. Each split keeps an
online softmax in float32 and writes its normalised partial output and log-sum-exp (base 2); a
second kernel merges the splits. With one split, the first kernel writes the output directly.

NOTE (CUDA graphs): the launch grid depends only on static facts (batch size, KV heads, the
block table's width, the SM count), never on device values or per-step host lists. Each split
covers `cdiv(num_tiles_of_this_sequence, num_splits)` tiles, computed in the kernel from
`seq_lens`; a split with nothing to do writes an empty partial (lse = -inf).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.specialize import STEP_INTS, TABLE_ARGS

# Tests set this to fill the split scratch buffers with NaN before each launch.
POISON_SCRATCH = False


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def dot_dtype_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast tiles to float32 before tl.dot, tl.dot input precision) for a cache dtype.

    NOTE: Triton 3.6's interpreter gets bf16 tl.dot wrong, so tiles are upcast there; float32
    inputs use exact ("ieee") products rather than TF32.
    """
    upcast = interpreting() or dtype == torch.float32
    return upcast, "ieee" if upcast else "tf32"


def split_scratch(shape: tuple[int, ...], device: torch.device, poison: bool) -> torch.Tensor:
    """A float32 buffer for the splits' partial outputs / log-sum-exps; NaN-filled when `poison`
    (a module's POISON_SCRATCH: tests catch a slot no split writes)."""
    if poison:
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)
    return torch.empty(shape, dtype=torch.float32, device=device)


@triton.jit
def _decode_tile(
    q, m_i, l_i, acc, start, hi, row_hi, bt_row, k_head, v_head, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, QLEN: tl.constexpr,
):  # fmt: skip
    """Keys `start .. start + BLOCK_N` (masked at `hi`, and for QLEN > 1 each query row at its
    own causal limit `row_hi` [G]) into the running softmax of q [G, D]."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = start + offs_n  # [BLOCK_N] token positions
    mask_n = pos < hi
    block = tl.load(bt_row + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
    slot = pos % PAGE
    k_off = block * stride_kb + slot * stride_kt  # [BLOCK_N] int64
    v_off = block * stride_vb + slot * stride_vt
    k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [G_PAD, BLOCK_N]
    if QLEN == 1:
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [G_PAD]
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [G_PAD, BLOCK_N]
    else:
        # a query row may see no key of this tile (its causal limit lies before it): its
        # running max stays -inf, so the exponents are taken against 0 there (no inf - inf)
        seen = mask_n[None, :] & (pos[None, :] < row_hi[:, None])
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [G_PAD]
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])  # [G_PAD, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=TABLE_ARGS)
def _decode_split_kernel(
    q_ptr,  # [B * QLEN (+pad), Hq, D]
    k_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_cache_ptr,  # [num_blocks, PAGE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B * QLEN (+pad), Hq, D] (written when NUM_SPLITS == 1)
    part_out_ptr,  # [B * QLEN, Hq, NUM_SPLITS, D] float32 (written when NUM_SPLITS > 1)
    part_lse_ptr,  # [B * QLEN, Hq, NUM_SPLITS] float32, base-2 log-sum-exp of the split's scores
    qk_scale,  # softmax scale * log2(e)
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
    GROUP: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,  # QLEN * GROUP padded to a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # tokens per tile (any power of two; tiles may span pages)
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    QLEN: tl.constexpr,  # query tokens per sequence
    PDL: tl.constexpr,
):
    pdl.wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, G_PAD)  # [G_PAD] query row: token offs_g // GROUP, head offs_g % GROUP
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    mask_g = offs_g < QLEN * GROUP
    tok = offs_g // GROUP  # [G_PAD] the row's token within the sequence's QLEN
    heads = kvh * GROUP + offs_g % GROUP  # [G_PAD] query heads
    token_rows = (b * QLEN + tok).to(tl.int64)  # [G_PAD] rows of q / out
    row_hi = seq_len - (QLEN - 1 - tok)  # [G_PAD] keys each query row sees (causal)

    q_ptrs = q_ptr + token_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None], other=0.0)  # [G_PAD, D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kvh.to(tl.int64) * stride_vh
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a runtime bound
        start = lo
        while start < hi:
            m_i, l_i, acc = _decode_tile(
                q, m_i, l_i, acc, start, hi, row_hi, bt_row, k_head, v_head, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt,
                HEAD_DIM, PAGE, BLOCK_N, UPCAST, PRECISION, QLEN,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in tl.range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _decode_tile(
                q, m_i, l_i, acc, start, hi, row_hi, bt_row, k_head, v_head, qk_scale,
                stride_kb, stride_kt, stride_vb, stride_vt,
                HEAD_DIM, PAGE, BLOCK_N, UPCAST, PRECISION, QLEN,
            )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [G_PAD, D]; zero for an empty split
    if NUM_SPLITS == 1:
        o_ptrs = (
            out_ptr + token_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        )
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        row = token_rows * (tl.num_programs(1) * GROUP) + heads  # [G_PAD] (token row, head)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row * NUM_SPLITS + split, lse, mask=mask_g)
        p_ptrs = part_out_ptr + (row * NUM_SPLITS + split)[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(p_ptrs, o, mask=mask_g[:, None])


@triton.jit
def merge_splits_kernel(
    part_out_ptr,  # [R, H, NUM_SPLITS, D_PAD] float32 (R token rows)
    part_lse_ptr,  # [R, H, NUM_SPLITS] float32, base-2 log-sum-exps
    out_ptr,  # [R(+pad), H, HEAD_DIM]
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # the partials' width (HEAD_DIM, or the next power of two above it)
    PDL: tl.constexpr,
):
    """Grid (token rows, H): the splits of one (row, head) weighted by their log-sum-exps; the
    split-KV decode of attention and of MLA (deltaserve.ops.mla.triton_decode) both end here."""
    pdl.wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = (b * tl.num_programs(1) + h).to(tl.int64)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_s = offs_s < NUM_SPLITS
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len 0): output zeros
    w = tl.exp2(lse - m)  # [S_PAD]; 0 for empty splits
    parts = tl.load(
        part_out_ptr + (row * NUM_SPLITS + offs_s)[:, None] * D_PAD + offs_d[None, :],
        mask=mask_s[:, None] & (w[:, None] > 0.0),
        other=0.0,
    )  # [S_PAD, D_PAD]
    total = tl.sum(w, axis=0)
    o = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)  # [D_PAD]
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_config(
    batch: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_blocks: int,
    page: int,
    dtype: torch.dtype,
    device: torch.device,
    query_len: int = 1,
) -> dict:
    """Tile sizes, warps and split count from static facts only (CUDA-graph safe).

    NOTE: tl.dot with the group padded to 16 rows beats a broadcast-multiply-reduce even for
    groups 1 and 2 (H200: 4.1 vs 2.0 / 1.1 TB/s): decode is bound by memory, not by the wasted
    tensor-core rows. Splits aim at ~4 programs per SM over the longest possible sequence.
    """
    g_pad = max(triton.next_power_of_2(query_len * group), 16)
    num_warps = 4
    if interpreting():
        block_n = 32
    elif head_dim >= 256:
        block_n = 32 if dtype == torch.float32 else 64
    else:
        block_n = 64 if dtype == torch.float32 else 128
    if g_pad >= 64 and not interpreting():
        # verify rows (q tokens x the group): the [G_PAD, D] accumulator and [G_PAD, BLOCK_N]
        # scores need more threads and a narrower key tile to stay in registers
        num_warps = 8
        block_n = min(block_n, 32 if g_pad * head_dim >= 64 * 256 else 64)
    num_tiles = triton.cdiv(max_blocks * page, block_n)  # tiles of the longest possible sequence
    if device.type == "cuda":
        target = 4 * num_sms(device.index if device.index is not None else 0)
    else:
        target = 1
    num_splits = max(1, min(triton.cdiv(target, batch * num_kv_heads), num_tiles, 64))
    return dict(
        G_PAD=g_pad, BLOCK_N=block_n, NUM_SPLITS=num_splits, num_warps=num_warps, num_stages=2
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    query_len: int = 1,
) -> torch.Tensor:
    """Decode attention over the paged cache: sequence b's queries are rows b * query_len + t
    of `q` (t < query_len), token t causal at position seq_lens[b] - query_len + t.

    Args:
        q: [T, Hq, D] with T >= B * query_len; rows past that (CUDA-graph padding) come back as
            zeros.
        k_cache, v_cache: [num_blocks, page, Hkv, D] (keys of this step already written).
        seq_lens: [B] int32 keys per sequence, this step's included (0: output zeros; a
            padded row's seq_len may be 0 for any query_len).
        block_tables: [B, max_blocks] int32 block ids.
        scale: softmax scale; out: optional [T, Hq, D] destination.
        config: overrides of `decode_config`'s choices (tests, benchmarks), e.g.
            {"NUM_SPLITS": 3, "BLOCK_N": 32, "num_warps": 8}.
        query_len: query tokens per sequence (1 + drafts in a verify step; at most 64).

    Returns:
        [T, Hq, D] in q's dtype.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    rows = batch * query_len
    assert num_q_heads == group * num_kv_heads and num_tokens >= rows and 1 <= query_len <= 64
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if num_tokens > rows:
        out[rows:].zero_()
    if batch == 0:
        return out
    cfg = decode_config(
        batch, num_kv_heads, group, head_dim, block_tables.shape[1], page, k_cache.dtype,
        q.device, query_len,
    )  # fmt: skip
    cfg.update(config or {})
    splits = cfg["NUM_SPLITS"]
    upcast, precision = dot_dtype_flags(k_cache.dtype)
    part_out = part_lse = out  # unused placeholders when there is one split
    if splits > 1:
        part_out = split_scratch((rows, num_q_heads, splits, head_dim), q.device, POISON_SCRATCH)
        part_lse = split_scratch((rows, num_q_heads, splits), q.device, POISON_SCRATCH)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, UPCAST=upcast, PRECISION=precision,
        INTERPRET=interpreting(), QLEN=query_len, **cfg,
        **pdl.launch_kwargs(q),
    )  # fmt: skip
    if splits > 1:
        merge_splits_kernel[(rows, num_q_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, S_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim,
            D_PAD=head_dim, num_warps=4 if head_dim >= 128 else 2,
            **pdl.launch_kwargs(part_out),
        )  # fmt: skip
    return out
