"""Absorbed MLA over a ragged batch in Triton (prefill chunks, decode rows, or a mix).

The same math as the split decode (triton_decode.py; both run triton_tiles.py's `mla_tile`): H
query heads over one `[c_kv | k_pe]` latent per token. Sequence b has `q_len` new tokens on top of
`seq_len - q_len` cached ones, all in the paged cache already. Its query rows are token-major
(row = i * H + h for its token i and head h); a program takes BLOCK_M consecutive rows of one
sequence (several tokens when H < BLOCK_M, part of one token's heads when H > BLOCK_M), so
every row shares each latent tile read. Causal: token i sits at position `context_len + i` and
sees latents 0 .. that position. Latent tiles that every row of the program sees in full run
without masks; only the diagonal and the tail are masked.

Grid: (T * H // BLOCK_M + B,). Sequence b's row tiles are programs
`query_start_loc[b] * H // BLOCK_M + b ..`; a program finds its sequence by binary search over
`query_start_loc` and exits when its tile is past the sequence's rows. Reads no host lists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops.attention.triton_decode import dot_dtype_flags, interpreting
from deltaserve.ops.mla.triton_decode import pad_dims
from deltaserve.ops.mla.triton_tiles import load_query_rows, mla_tile
from deltaserve.ops.specialize import STEP_INTS, TABLE_ARGS


@triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=TABLE_ARGS)
def _mla_prefill_kernel(
    q_lat_ptr,  # [T, H, R]
    q_pe_ptr,  # [T, H, P]
    cache_ptr,  # [num_blocks, PAGE, R + P]
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [T, H, R]
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    H: tl.constexpr,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    P: tl.constexpr,
    P_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows (token, head) per program
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    # the last sequence b whose first tile `query_start_loc[b] * H // BLOCK_M + b` is <= pid
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) * H // BLOCK_M + mid
        go_right = (first_tile <= pid).to(tl.int32)
        lo = lo + go_right * (mid - lo)
        hi = mid - 1 + go_right * (hi - mid + 1)
    b = lo
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    num_row_tiles = tl.cdiv(q_len * H, BLOCK_M)
    local = pid - (q_start * H // BLOCK_M + b)
    if local >= num_row_tiles:
        return
    tile = num_row_tiles - 1 - local  # the longest (last) row tiles start first
    seq_len = tl.load(seq_lens_ptr + b)
    context_len = seq_len - q_len

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] row of the sequence
    mask_m = offs_m < q_len * H
    tok = offs_m // H  # [BLOCK_M] query token within the sequence
    heads = offs_m % H
    token_rows = (q_start + tok).to(tl.int64)
    row_hi = context_len + tok + 1  # [BLOCK_M] latents each row sees (causal)
    q_lat, q_pe = load_query_rows(
        q_lat_ptr, q_pe_ptr, token_rows, heads, mask_m, stride_qt, stride_qh, stride_pt,
        stride_ph, R, R_PAD, P, P_PAD, UPCAST,
    )  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    first_tok = tile * BLOCK_M // H
    kv_end = tl.minimum(context_len + (tile * BLOCK_M + BLOCK_M - 1) // H + 1, seq_len)
    full_end = (context_len + first_tok + 1) // BLOCK_N * BLOCK_N  # seen by every row
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a runtime bound
        start = 0
        while start < full_end:
            m_i, l_i, acc = mla_tile(
                q_lat, q_pe, m_i, l_i, acc, start, kv_end, row_hi, bt_row, cache_ptr,
                qk_scale, stride_cb, stride_cs, 0, 0, cache_ptr, cache_ptr, 0, 0, R, R_PAD, P,
                P_PAD, PAGE, BLOCK_N, False, False, UPCAST, PRECISION, False,
            )  # fmt: skip
            start += BLOCK_N
        while start < kv_end:
            m_i, l_i, acc = mla_tile(
                q_lat, q_pe, m_i, l_i, acc, start, kv_end, row_hi, bt_row, cache_ptr,
                qk_scale, stride_cb, stride_cs, 0, 0, cache_ptr, cache_ptr, 0, 0, R, R_PAD, P,
                P_PAD, PAGE, BLOCK_N, True, True, UPCAST, PRECISION, False,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in tl.range(0, full_end, BLOCK_N):
            m_i, l_i, acc = mla_tile(
                q_lat, q_pe, m_i, l_i, acc, start, kv_end, row_hi, bt_row, cache_ptr,
                qk_scale, stride_cb, stride_cs, 0, 0, cache_ptr, cache_ptr, 0, 0, R, R_PAD, P,
                P_PAD, PAGE, BLOCK_N, False, False, UPCAST, PRECISION, False,
            )  # fmt: skip
        for start in tl.range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = mla_tile(
                q_lat, q_pe, m_i, l_i, acc, start, kv_end, row_hi, bt_row, cache_ptr,
                qk_scale, stride_cb, stride_cs, 0, 0, cache_ptr, cache_ptr, 0, 0, R, R_PAD, P,
                P_PAD, PAGE, BLOCK_N, True, True, UPCAST, PRECISION, False,
            )  # fmt: skip

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    offs_r = tl.arange(0, R_PAD)
    o_ptrs = out_ptr + token_rows[:, None] * stride_ot + heads[:, None] * stride_oh
    o_mask = mask_m[:, None] & (offs_r < R)[None, :]
    tl.store(o_ptrs + offs_r[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)


def prefill_config(r: int, dtype: torch.dtype) -> dict:
    """Tile sizes and warps (static in the shapes)."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if r > 256 or dtype == torch.float32:
        # NOTE: sm_90 compiles (tests/ops/test_mla_sm90_compile.py): BLOCK_M 64 spills at R 512
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


def mla_prefill(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Causal absorbed MLA of a ragged batch over the paged latent cache (latents written).

    Args:
        q_lat: [T, H, R]; q_pe: [T, H, P]; sequence b owns token rows
            `query_start_loc[b] : query_start_loc[b + 1]`. Rows past `query_start_loc[-1]`
            come back as zeros (untouched in a given `out`).
        latent_cache: [num_blocks, page, R + P].
        query_start_loc: [B + 1] int32; seq_lens: [B] int32 (cached + new latents).
        block_tables: [B, max_blocks] int32.
        scale: softmax scale; out: optional [T, H, R] destination; config: overrides of
            `prefill_config`.

    Returns:
        [T, H, R] in q_lat's dtype.
    """
    num_tokens, num_heads, r = q_lat.shape
    p = q_pe.shape[-1]
    _, page, width = latent_cache.shape
    batch = seq_lens.shape[0]
    if r + p != width or q_pe.shape[:2] != (num_tokens, num_heads):
        raise ValueError(
            f"q_lat {tuple(q_lat.shape)} / q_pe {tuple(q_pe.shape)} do not match a latent "
            f"cache of width {width}"
        )
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and latent_cache.stride(-1) == 1
    if out is None:
        out = torch.zeros_like(q_lat)  # rows owned by no sequence stay zero
    if batch == 0 or num_tokens == 0:
        return out
    cfg = prefill_config(r, latent_cache.dtype)
    cfg.update(config or {})
    r_pad, p_pad = pad_dims(r, p)
    upcast, precision = dot_dtype_flags(latent_cache.dtype)
    grid = (num_tokens * num_heads // cfg["BLOCK_M"] + batch,)
    _mla_prefill_kernel[grid](
        q_lat, q_pe, latent_cache, block_tables, query_start_loc, seq_lens, out,
        scale * 1.4426950408889634, batch,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        H=num_heads, R=r, R_PAD=r_pad, P=p, P_PAD=p_pad, PAGE=page, UPCAST=upcast,
        PRECISION=precision, INTERPRET=interpreting(), **cfg,
    )  # fmt: skip
    return out
