"""The tile math of the Triton MLA kernels (the split decode, triton_decode.py, and the ragged
prefill, triton_prefill.py): one tile of BLOCK_N latents gathered through the block table into
the running base-2 softmax of M query rows, whole (`mla_tile`) or with the latent width in
column chunks (`mla_tile_chunked`), and the query rows' loads. Every function is inlined into
the kernel that calls it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def latent_rows(
    start, hi, bt_row, cache_ptr, stride_cb, stride_cs,
    new_lo, new_row0, c_new_ptr, pe_new_ptr, stride_nc, stride_np,
    R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    NEW: tl.constexpr,
):  # fmt: skip
    """The tile of latents `start .. start + BLOCK_N`: (pos [BLOCK_N] positions, mask_n
    (pos < hi; only MASKED tiles read it), c_rows / pe_rows [BLOCK_N] row pointers gathered
    through the block table, this step's rows instead where NEW: see `mla_tile`)."""
    pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] latent positions
    mask_n = pos < hi
    if MASKED:
        block = tl.load(bt_row + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + pos // PAGE).to(tl.int64)
    row = block * stride_cb + (pos % PAGE) * stride_cs  # [BLOCK_N] int64 row offsets
    c_rows = cache_ptr + row  # [BLOCK_N] row pointers
    pe_rows = cache_ptr + R + row
    if NEW:
        # this step's latents from the layer's rows (the cache may not hold them yet): one load
        # either way, each row's pointer picked (c_new / pe_new share the cache's dtype)
        fresh = pos >= new_lo
        src = new_row0 + tl.maximum(pos - new_lo, 0).to(tl.int64)  # token rows (where fresh)
        c_rows = tl.where(fresh, c_new_ptr + src * stride_nc, c_rows)
        pe_rows = tl.where(fresh, pe_new_ptr + src * stride_np, pe_rows)
    return pos, mask_n, c_rows, pe_rows


@triton.jit
def online_softmax(
    s, m_i, l_i, pos, mask_n, row_hi, qk_scale, MASKED: tl.constexpr, ROW_LIMIT: tl.constexpr
):
    """One tile's scores s [M, BLOCK_N] into the running base-2 softmax: (p [M, BLOCK_N],
    alpha [M] the accumulator's rescale, the new running max and sum)."""
    if ROW_LIMIT:
        seen = pos[None, :] < row_hi[:, None]
        if MASKED:
            seen = seen & mask_n[None, :]
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [M]
        # a row that has seen nothing yet keeps max -inf: exponents against 0 (no inf - inf)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        if MASKED:
            s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
        else:
            s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])  # [M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def mla_tile(
    q_lat, q_pe, m_i, l_i, acc, start, hi, row_hi, bt_row, cache_ptr, qk_scale,
    stride_cb, stride_cs,
    new_lo, new_row0, c_new_ptr, pe_new_ptr, stride_nc, stride_np,
    R: tl.constexpr, R_PAD: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ROW_LIMIT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, NEW: tl.constexpr,
):  # fmt: skip
    """Latents `start .. start + BLOCK_N` into the running softmax of the query rows q_lat
    [M, R_PAD], q_pe [M, P_PAD]. MASKED: latents at or past `hi` are masked; ROW_LIMIT: each
    row sees only latents before its own limit `row_hi` [M] (causal rows; a row may see none
    of the tile). NEW: latents at or past `new_lo` are this step's, read from token rows
    `new_row0 + (pos - new_lo)` of c_new [T, R] / pe_new [T, P] (the cache's dtype) instead of
    the cache. Returns the new (m_i, l_i, acc) (base-2 running max, sum, [M, R_PAD])."""
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, P_PAD)
    pos, mask_n, c_rows, pe_rows = latent_rows(
        start, hi, bt_row, cache_ptr, stride_cb, stride_cs, new_lo, new_row0, c_new_ptr,
        pe_new_ptr, stride_nc, stride_np, R, PAGE, BLOCK_N, MASKED, NEW,
    )  # fmt: skip
    c_ptrs = c_rows[:, None] + offs_r[None, :]
    pe_ptrs = pe_rows[:, None] + offs_p[None, :]
    if MASKED:
        c = tl.load(c_ptrs, mask=mask_n[:, None] & (offs_r < R)[None, :], other=0.0)
        pe = tl.load(pe_ptrs, mask=mask_n[:, None] & (offs_p < P)[None, :], other=0.0)
    else:
        c = tl.load(c_ptrs, mask=(offs_r < R)[None, :], other=0.0)  # [BLOCK_N, R_PAD]
        pe = tl.load(pe_ptrs, mask=(offs_p < P)[None, :], other=0.0)  # [BLOCK_N, P_PAD]
    if UPCAST:
        c = c.to(tl.float32)
        pe = pe.to(tl.float32)
    s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)  # [M, BLOCK_N]
    s = tl.dot(q_pe, tl.trans(pe), acc=s, input_precision=PRECISION)
    p, alpha, m_new, l_i = online_softmax(s, m_i, l_i, pos, mask_n, row_hi, qk_scale, MASKED,
                                          ROW_LIMIT)  # fmt: skip
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def load_query_rows(
    q_lat_ptr, q_pe_ptr, token_rows, heads, mask_m,
    stride_qt, stride_qh, stride_pt, stride_ph,
    R: tl.constexpr, R_PAD: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """q_lat [M, R_PAD] and q_pe [M, P_PAD] of query rows (token row, head), zero where masked."""
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, P_PAD)
    ql_ptrs = q_lat_ptr + token_rows[:, None] * stride_qt + heads[:, None] * stride_qh
    qp_ptrs = q_pe_ptr + token_rows[:, None] * stride_pt + heads[:, None] * stride_ph
    q_lat = tl.load(
        ql_ptrs + offs_r[None, :], mask=mask_m[:, None] & (offs_r < R)[None, :], other=0.0
    )
    q_pe = tl.load(
        qp_ptrs + offs_p[None, :], mask=mask_m[:, None] & (offs_p < P)[None, :], other=0.0
    )
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    return q_lat, q_pe


@triton.jit
def mla_tile_chunked(
    q_lats, q_pe, m_i, l_i, accs, start, hi, row_hi, bt_row, cache_ptr, qk_scale,
    stride_cb, stride_cs,
    new_lo, new_row0, c_new_ptr, pe_new_ptr, stride_nc, stride_np,
    R: tl.constexpr, RC: tl.constexpr, R_CHUNKS: tl.constexpr, P: tl.constexpr,
    P_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    ROW_LIMIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, NEW: tl.constexpr,
):  # fmt: skip
    """`mla_tile` with the latent width in R_CHUNKS column chunks of RC: q_lats and accs are
    tuples of R_CHUNKS [M, RC] tensors (query chunks, accumulator chunks), and the latent tile
    is read as R_CHUNKS [BLOCK_N, RC] tiles, each multiplied on its own. Why: the whole
    [BLOCK_N, R] tile as one product's operand sits in registers beside the [M, R] float32
    accumulator (208 registers a thread at R 512, BLOCK_H 16, BLOCK_N 32, 4 warps for sm_90:
    two programs an SM); one chunk at a time needs fewer, so more programs fit an SM.
    Returns (m_i, l_i, accs)."""
    offs_c = tl.arange(0, RC)
    offs_p = tl.arange(0, P_PAD)
    pos, mask_n, c_rows, pe_rows = latent_rows(
        start, hi, bt_row, cache_ptr, stride_cb, stride_cs, new_lo, new_row0, c_new_ptr,
        pe_new_ptr, stride_nc, stride_np, R, PAGE, BLOCK_N, MASKED, NEW,
    )  # fmt: skip
    if not MASKED:
        mask_n = pos >= 0  # every latent of the tile
    pe = tl.load(
        pe_rows[:, None] + offs_p[None, :],
        mask=mask_n[:, None] & (offs_p < P)[None, :],
        other=0.0,
    )  # [BLOCK_N, P_PAD]
    if UPCAST:
        pe = pe.to(tl.float32)
    s = tl.dot(q_pe, tl.trans(pe), input_precision=PRECISION)  # [M, BLOCK_N]
    cs = ()
    for j in tl.static_range(R_CHUNKS):
        cols = j * RC + offs_c
        c = tl.load(
            c_rows[:, None] + cols[None, :],
            mask=mask_n[:, None] & (cols < R)[None, :],
            other=0.0,
        )  # [BLOCK_N, RC]
        if UPCAST:
            c = c.to(tl.float32)
        s = tl.dot(q_lats[j], tl.trans(c), acc=s, input_precision=PRECISION)
        cs = cs + (c,)
    p, alpha, m_new, l_i = online_softmax(s, m_i, l_i, pos, mask_n, row_hi, qk_scale, MASKED,
                                          ROW_LIMIT)  # fmt: skip
    new_accs = ()
    for j in tl.static_range(R_CHUNKS):
        c = cs[j]
        acc = accs[j] * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
        new_accs = new_accs + (acc,)
    return m_new, l_i, new_accs


@triton.jit
def load_query_chunks(
    q_lat_ptr, token_rows, heads, mask_m, stride_qt, stride_qh,
    R: tl.constexpr, RC: tl.constexpr, R_CHUNKS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """q_lat of query rows (token row, head) as a tuple of R_CHUNKS [M, RC] column chunks."""
    offs_c = tl.arange(0, RC)
    ql_ptrs = q_lat_ptr + token_rows[:, None] * stride_qt + heads[:, None] * stride_qh
    out = ()
    for j in tl.static_range(R_CHUNKS):
        cols = j * RC + offs_c
        q = tl.load(ql_ptrs + cols[None, :], mask=mask_m[:, None] & (cols < R)[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        out = out + (q,)
    return out


@triton.jit
def split_tile(
    q_lat, q_pe, m_i, l_i, acc, start, hi, row_hi, bt_row, cache_ptr, qk_scale,
    stride_cb, stride_cs,
    new_lo, new_row0, c_new_ptr, pe_new_ptr, stride_nc, stride_np,
    R: tl.constexpr, R_PAD: tl.constexpr, R_CHUNKS: tl.constexpr, P: tl.constexpr,
    P_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, ROW_LIMIT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, NEW: tl.constexpr,
):  # fmt: skip
    """One masked tile of the split decode: `mla_tile` (R_CHUNKS 1: q_lat and acc whole) or
    `mla_tile_chunked` (q_lat and acc tuples of R_CHUNKS column chunks)."""
    if R_CHUNKS == 1:
        m_i, l_i, acc = mla_tile(
            q_lat, q_pe, m_i, l_i, acc, start, hi, row_hi, bt_row, cache_ptr, qk_scale,
            stride_cb, stride_cs, new_lo, new_row0, c_new_ptr, pe_new_ptr, stride_nc, stride_np,
            R, R_PAD, P, P_PAD, PAGE, BLOCK_N, True, ROW_LIMIT, UPCAST, PRECISION, NEW,
        )  # fmt: skip
    else:
        m_i, l_i, acc = mla_tile_chunked(
            q_lat, q_pe, m_i, l_i, acc, start, hi, row_hi, bt_row, cache_ptr, qk_scale,
            stride_cb, stride_cs, new_lo, new_row0, c_new_ptr, pe_new_ptr, stride_nc, stride_np,
            R, R_PAD // R_CHUNKS, R_CHUNKS, P, P_PAD, PAGE, BLOCK_N, True, ROW_LIMIT, UPCAST,
            PRECISION, NEW,
        )  # fmt: skip
    return m_i, l_i, acc
