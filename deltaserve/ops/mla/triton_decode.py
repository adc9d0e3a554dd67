"""Absorbed MLA decode in Triton: split over the latent sequence (flash-decoding), QLEN query
tokens per sequence (1, or 1 + k drafts when verifying).

The decode is an MQA of H query heads over one latent per token: each query row (token t, head
h) holds q_lat [R] and q_pe [P]; each cached row is `[c_kv (R) | k_pe (P)]`, the key of every
head and (its c_kv part) the value. Grid (row_tiles, B, NUM_SPLITS): a program takes BLOCK_H
query rows of one sequence (rows are token-major, row = t * H + h, so with QLEN > 1 a tile may
hold several tokens) and a contiguous range of that sequence's cached latents, read in tiles
of BLOCK_N tokens gathered across pages through the block table. Every query row of the program
shares each latent tile it reads; the row tiles of one (sequence, split) are adjacent program
ids, so when H needs several tiles they run together and the repeats hit L2. Both products
(q . latent, p . c_kv) use tl.dot; the online softmax and the accumulator are float32. Each
split writes its normalised partial output and base-2 log-sum-exp; the attention decode's merge
kernel (merge_splits_kernel) combines them.
With one split the first kernel writes the output directly. Given the step's new latents
(NEW: all-decode steps by default), the first row tile of the split holding a new position also
stores it into the cache, and every query reads the step's own latents from the layer's rows
instead of the cache, so no program depends on that store (one writer launch fewer per layer).

A transposed form (the latent tile as the products' M side, so that they compile to Hopper's
warpgroup MMAs reading it from shared memory) measured 1.4-1.5x slower at 16 heads and 3.3x at
128 (docs/benchmarks.md, "Absorbed MLA decode kernels") and was removed.

Query token t of a sequence with `seq_len` latents (this step's included) is causal: it sees
latents 0 .. seq_len - QLEN + t.

NOTE (CUDA graphs): the grid depends only on static facts (batch size, H, QLEN, the block
table's width, the SM count), never on device values or host lists. Each split covers
`cdiv(num_tiles_of_this_sequence, NUM_SPLITS)` tiles, computed in the kernel from `seq_lens`;
a split with nothing to do writes lse = -inf only (every merge skips its partial).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve import env
from deltaserve.ops import pdl
from deltaserve.ops.attention.triton_decode import (
    dot_dtype_flags,
    interpreting,
    merge_splits_kernel,
    num_sms,
    split_scratch,
)
from deltaserve.ops.mla.triton_head_matmul import head_matmul_any_rows
from deltaserve.ops.mla.triton_merge_out import MAX_ROWS as MERGE_MAX_ROWS
from deltaserve.ops.mla.triton_merge_out import merge_w_uv
from deltaserve.ops.mla.triton_tiles import load_query_chunks, load_query_rows, split_tile
from deltaserve.ops.specialize import STEP_INTS, TABLE_ARGS

# Tests set this to fill the split scratch buffers with NaN before each launch.
POISON_SCRATCH = False


@triton.jit(do_not_specialize=STEP_INTS, do_not_specialize_on_alignment=TABLE_ARGS)
def _mla_decode_split_kernel(
    q_lat_ptr,  # [B * QLEN (+pad), H, R]
    q_pe_ptr,  # [B * QLEN (+pad), H, P]
    cache_ptr,  # [num_blocks, PAGE, R + P]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B * QLEN (+pad), H, R] (written when NUM_SPLITS == 1)
    part_out_ptr,  # [B * QLEN, H, NUM_SPLITS, R_PAD] float32 (NUM_SPLITS > 1)
    part_lse_ptr,  # [B * QLEN, H, NUM_SPLITS] float32, base-2 log-sum-exp
    c_new_ptr,  # [B * QLEN (+pad), R] this step's latents (NEW)
    pe_new_ptr,  # [B * QLEN (+pad), P]
    slots_ptr,  # [B * QLEN (+pad)] int64 cache slots of the step's latents; -1 skips one (NEW)
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_nc,
    stride_np,
    H: tl.constexpr,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    P: tl.constexpr,
    P_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query rows per program (power of two >= 16)
    BLOCK_N: tl.constexpr,  # latents per tile (power of two >= 16; tiles may span pages)
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    QLEN: tl.constexpr,
    QLEN_PAD: tl.constexpr,
    NEW: tl.constexpr,  # write this step's latents (c_new / pe_new at slot) and read them there
    PDL: tl.constexpr,
    R_CHUNKS: tl.constexpr,  # latent column chunks (mla_tile_chunked); 1: the whole width
):
    pdl.wait(PDL)
    rt = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

    offs_m = rt * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] row = token * H + head
    mask_m = offs_m < QLEN * H
    tok = offs_m // H
    heads = offs_m % H
    token_rows = (b * QLEN + tok).to(tl.int64)
    row_hi = seq_len - (QLEN - 1 - tok)  # [BLOCK_H] latents each row sees (causal)
    RC: tl.constexpr = R_PAD // R_CHUNKS
    if R_CHUNKS == 1:
        q_lat, q_pe = load_query_rows(
            q_lat_ptr, q_pe_ptr, token_rows, heads, mask_m, stride_qt, stride_qh, stride_pt,
            stride_ph, R, R_PAD, P, P_PAD, UPCAST,
        )  # fmt: skip
    else:  # q_lat and acc as tuples of R_CHUNKS column chunks (mla_tile_chunked)
        q_lat = load_query_chunks(
            q_lat_ptr, token_rows, heads, mask_m, stride_qt, stride_qh, R, RC, R_CHUNKS, UPCAST
        )
        offs_qp = tl.arange(0, P_PAD)
        q_pe = tl.load(
            q_pe_ptr + token_rows[:, None] * stride_pt + heads[:, None] * stride_ph
            + offs_qp[None, :],
            mask=mask_m[:, None] & (offs_qp < P)[None, :],
            other=0.0,
        )  # fmt: skip
        if UPCAST:
            q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if R_CHUNKS == 1:
        acc = tl.zeros([BLOCK_H, R_PAD], dtype=tl.float32)
    else:
        acc = ()
        for _j in tl.static_range(R_CHUNKS):
            acc = acc + (tl.zeros([BLOCK_H, RC], dtype=tl.float32),)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    new_lo = seq_len - QLEN  # the step's own latents sit at new_lo .. seq_len - 1
    new_row0 = (b * QLEN).to(tl.int64)
    mid = hi  # tiles before `mid` hold cached latents only
    if NEW:
        if rt == 0:
            # the first row tile stores the step's latents that fall in this split's range
            # (no program reads them from the cache in this launch)
            offs_t = tl.arange(0, QLEN_PAD)
            pos_t = new_lo + offs_t
            mine = (offs_t < QLEN) & (pos_t >= lo) & (pos_t < hi)
            slot = tl.load(slots_ptr + new_row0 + offs_t, mask=mine, other=-1).to(tl.int64)
            mine = mine & (slot >= 0)
            dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs  # [QLEN_PAD]
            rows_t = new_row0 + offs_t
            offs_r = tl.arange(0, R_PAD)
            offs_p = tl.arange(0, P_PAD)
            c_t = tl.load(
                c_new_ptr + rows_t[:, None] * stride_nc + offs_r[None, :],
                mask=mine[:, None] & (offs_r < R)[None, :],
            )  # fmt: skip
            pe_t = tl.load(
                pe_new_ptr + rows_t[:, None] * stride_np + offs_p[None, :],
                mask=mine[:, None] & (offs_p < P)[None, :],
            )  # fmt: skip
            tl.store(
                dst[:, None] + offs_r[None, :], c_t.to(cache_ptr.dtype.element_ty),
                mask=mine[:, None] & (offs_r < R)[None, :],
            )  # fmt: skip
            tl.store(
                dst[:, None] + R + offs_p[None, :], pe_t.to(cache_ptr.dtype.element_ty),
                mask=mine[:, None] & (offs_p < P)[None, :],
            )  # fmt: skip
        # whole tiles before new_lo read the cache alone; the rest take the fresh rows too
        mid = tl.minimum(hi, lo + (tl.maximum(new_lo - lo, 0) // BLOCK_N) * BLOCK_N)
    if INTERPRET:
        # NOTE: the interpreter (with numpy >= 2.4) cannot take `range` over a runtime bound
        start = lo
        while start < mid:
            m_i, l_i, acc = split_tile(
                q_lat, q_pe, m_i, l_i, acc, start, hi, row_hi, bt_row, cache_ptr, qk_scale,
                stride_cb, stride_cs, new_lo, new_row0, c_new_ptr, pe_new_ptr, stride_nc,
                stride_np, R, R_PAD, R_CHUNKS, P, P_PAD, PAGE, BLOCK_N, QLEN > 1, UPCAST,
                PRECISION, False,
            )  # fmt: skip
            start += BLOCK_N
        while start < hi:
            m_i, l_i, acc = split_tile(
                q_lat, q_pe, m_i, l_i, acc, start, hi, row_hi, bt_row, cache_ptr, qk_scale,
                stride_cb, stride_cs, new_lo, new_row0, c_new_ptr, pe_new_ptr, stride_nc,
                stride_np, R, R_PAD, R_CHUNKS, P, P_PAD, PAGE, BLOCK_N, QLEN > 1, UPCAST,
                PRECISION, NEW,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in tl.range(lo, mid, BLOCK_N):
            m_i, l_i, acc = split_tile(
                q_lat, q_pe, m_i, l_i, acc, start, hi, row_hi, bt_row, cache_ptr, qk_scale,
                stride_cb, stride_cs, new_lo, new_row0, c_new_ptr, pe_new_ptr, stride_nc,
                stride_np, R, R_PAD, R_CHUNKS, P, P_PAD, PAGE, BLOCK_N, QLEN > 1, UPCAST,
                PRECISION, False,
            )  # fmt: skip
        if NEW:
            for start in tl.range(mid, hi, BLOCK_N):
                m_i, l_i, acc = split_tile(
                    q_lat, q_pe, m_i, l_i, acc, start, hi, row_hi, bt_row, cache_ptr,
                    qk_scale, stride_cb, stride_cs, new_lo, new_row0, c_new_ptr, pe_new_ptr,
                    stride_nc, stride_np, R, R_PAD, R_CHUNKS, P, P_PAD, PAGE, BLOCK_N,
                    QLEN > 1, UPCAST, PRECISION, True,
                )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    accs = (acc,) if R_CHUNKS == 1 else acc
    offs_c = tl.arange(0, RC)
    for j in tl.static_range(R_CHUNKS):
        o = accs[j] / l_safe[:, None]  # [BLOCK_H, RC]; zero for an empty split
        cols = j * RC + offs_c
        if NUM_SPLITS == 1:
            o_ptrs = out_ptr + token_rows[:, None] * stride_ot + heads[:, None] * stride_oh
            o_mask = mask_m[:, None] & (cols < R)[None, :]
            tl.store(o_ptrs + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            row = token_rows * H + heads  # [BLOCK_H] (token row, head)
            if j == 0:
                lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
                tl.store(part_lse_ptr + row * NUM_SPLITS + split, lse, mask=mask_m)
            p_ptrs = part_out_ptr + (row * NUM_SPLITS + split)[:, None] * R_PAD + cols[None, :]
            # a row that saw no latent here (lse -inf) weighs 0 in every merge, which never
            # reads its partial: not stored (at short contexts most splits are empty)
            tl.store(p_ptrs, o, mask=(mask_m & (l_i > 0.0))[:, None])


def pad_dims(r: int, p: int) -> tuple[int, int]:
    """R and P padded to powers of two >= 16 (tl.dot's minimum inner size)."""
    return max(16, triton.next_power_of_2(r)), max(16, triton.next_power_of_2(p))


def decode_config(
    batch: int,
    num_heads: int,
    r: int,
    max_blocks: int,
    page: int,
    dtype: torch.dtype,
    device: torch.device,
    query_len: int = 1,
    overrides: dict | None = None,
) -> dict:
    """Tile sizes, warps and split count from static facts only (CUDA-graph safe).

    BLOCK_H query rows share each latent tile; with H = 16 one tile holds all heads. The split
    count fills PROGRAMS_PER_SM programs an SM over the whole batch, one wave (how many fit is
    set by the registers a program takes), never more than the longest possible sequence has
    tiles. `overrides` (tests, benchmarks) replace any choice before the split count is taken
    from them (PROGRAMS_PER_SM, set by the tile's register use, is consumed here; `maxnreg`
    caps a program's registers, no default sets it), and a None value drops a key.
    """
    rows = query_len * num_heads
    per_sm, chunks = 2, 1
    if interpreting():
        block_h, block_n, warps, stages = 16, 16, 4, 1
    else:
        wide = r > 256 or dtype == torch.float32
        block_h = min(32 if wide else 64, max(16, triton.next_power_of_2(rows)))
        block_n = 32 if wide else 64
        # NOTE: sm_90 compiles (tests/ops/test_mla_sm90_compile.py): R 512 with 4 warps takes
        # 208 registers at BLOCK_H 16 and spills at BLOCK_H 32; 8 warps take 112 / 182
        warps, stages = (8 if wide or block_h * r >= 32 * 512 else 4), 2
        if wide and rows <= 16 and dtype != torch.float32 and r > 256:
            # The latent width in 8 column chunks (triton_tiles.mla_tile_chunked) over tiles of
            # 64 latents, three stages, no register cap (145 registers a thread, no spills;
            # 94.5 KB of shared memory a program, within the 99 KB a block of sm_86 / sm_89).
            # Measured (bench kernels --only mla, one H200, H 16, context 4096; FlashInfer
            # 86.08 / 29.74 / 16.53 us in the same call): 83.4 / 30.5 / 11.0 us at B 64 / 16 /
            # 1 (B 64: 3.62 TB/s), against 84.6 / 30.9 / 11.3 with two stages and 89.5 / 36.8 /
            # 12.5 with the earlier tiles of 32 in 128 registers at four programs an SM; at
            # B 64, 6 or 8 splits took 101.9 / 94.5 us where two programs an SM give 4
            block_n, warps, stages, chunks, per_sm = 64, 4, 3, 8, 2
        elif wide and rows <= 16:
            # measured (bench kernels --only mla, H200, H 16, context 4096): 4 warps take 114 /
            # 39 / 14.7 us at B 64 / 16 / 1 against 8 warps' 139 / 45 / 16.3
            warps = 4
        elif r > 256 and dtype != torch.float32 and rows >= 64:
            # the latent width in 8 column chunks, no register cap (a few bytes of spill at
            # 255 registers; the whole tile spilled ~500). Measured against the whole tile at
            # each choice below (bench kernels --only mla, one H200, H 128)
            chunks = 8
            if batch * rows <= 256:
                # a sequence or two: the most programs. Measured at H 128, B 1: 19.8 / 8.5 us
                # at context 4096 / 512 against 24.3 / 13.0 with 64 rows per program; in
                # chunks 16.6 / 6.9 against the whole tile's 18.9 / 7.9
                block_h, warps = 16, 4
            else:
                # 64 query rows per program: the products run as Hopper's warpgroup MMAs (M 64).
                # Measured at H 128 (H200), context 4096, B 64 / 16: 346 / 109 us with 64
                # latents a tile against 971 / 264 at BLOCK_H 32, BLOCK_N 32. In chunks, one
                # 8-warp program an SM (its shared memory): 286.4 / 84.2 us at B 64 / 16
                # (context 512, B 64: 44.4 against 72.8), against 302.5 / 95.2 at two programs
                # an SM and the whole tile's 347.6 / 109.5
                block_h, block_n, per_sm = 64, 64, 1
    cfg = dict(BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
               R_CHUNKS=chunks, PROGRAMS_PER_SM=per_sm)  # fmt: skip
    cfg.update(overrides or {})
    per_sm = cfg.pop("PROGRAMS_PER_SM") or 2
    if cfg.get("NUM_SPLITS") is None:
        row_tiles = triton.cdiv(rows, cfg["BLOCK_H"])
        num_tiles = triton.cdiv(max_blocks * page, cfg["BLOCK_N"])
        if device.type == "cuda":
            target = per_sm * num_sms(device.index if device.index is not None else 0)
            splits = round(target / (batch * row_tiles))
        else:
            splits = 1
        cfg["NUM_SPLITS"] = max(1, min(splits, num_tiles, 32))
    return {k: v for k, v in cfg.items() if v is not None}


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    query_len: int = 1,
    w_uv: torch.Tensor | None = None,
    new_latents: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over the paged latent cache: sequence b's queries are token rows
    b * query_len + t (t < query_len), token t causal at position seq_lens[b] - query_len + t.
    This step's latents are already in the cache, or (`new_latents`) the kernel writes them
    itself.

    Args:
        q_lat: [T, H, R]; q_pe: [T, H, P]; T >= B * query_len; rows past that (CUDA-graph
            padding) come back as zeros.
        latent_cache: [num_blocks, page, R + P], unit stride in the last dim.
        seq_lens: [B] int32 latents per sequence, this step's included (0: output zeros).
        block_tables: [B, max_blocks] int32 block ids.
        scale: softmax scale; out: optional [T, H, R] destination.
        config: overrides of `decode_config`'s choices (tests, benchmarks), e.g.
            {"NUM_SPLITS": 3, "BLOCK_N": 32, "BLOCK_H": 16, "num_warps": 8, "R_CHUNKS": 4}
            (`decode_config`'s `overrides`: PROGRAMS_PER_SM too, and None drops a key).
        query_len: query tokens per sequence (1 + drafts in a verify step).
        w_uv: W_UV [H, R, V]: the result is the layer's per-head product out @ W_UV, [T, H, V]
            (with several splits and at most triton_merge_out.MAX_ROWS rows under
            DELTASERVE_MLA_MERGE=fused, merged and multiplied in one launch; else the
            per-head matmul after the merge).
        new_latents: (c_kv [T, R], k_pe [T, P], slot_mapping [>= B * query_len] int64) of the
            step's tokens (token rows as the queries'; slot -1 skips a token): written into
            the cache by this launch (what `store_latent` would do first), and each query
            reads them from c_kv / k_pe, never from the cache, so no program waits on the
            write (DELTASERVE_MLA_STORE=fused).

    Returns:
        [T, H, R] in q_lat's dtype ([T, H, V] with w_uv).
    """
    num_tokens, num_heads, r = q_lat.shape
    p = q_pe.shape[-1]
    _, page, width = latent_cache.shape
    batch = seq_lens.shape[0]
    rows = batch * query_len
    if r + p != width or q_pe.shape[:2] != (num_tokens, num_heads):
        raise ValueError(
            f"q_lat {tuple(q_lat.shape)} / q_pe {tuple(q_pe.shape)} do not match a latent "
            f"cache of width {width}"
        )
    assert num_tokens >= rows and query_len >= 1
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and latent_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q_lat)
    if num_tokens > rows:
        out[rows:].zero_()
    if batch == 0:
        return out if w_uv is None else head_matmul_any_rows(out, w_uv)
    cfg = decode_config(
        batch, num_heads, r, block_tables.shape[1], page, latent_cache.dtype, q_lat.device,
        query_len, config,
    )  # fmt: skip
    splits = cfg["NUM_SPLITS"]
    r_pad, p_pad = pad_dims(r, p)
    chunks = cfg["R_CHUNKS"]
    if chunks < 1 or r_pad % chunks or r_pad // chunks < 16 or chunks & (chunks - 1):
        raise ValueError(
            f"R_CHUNKS must be a power of two splitting the padded latent width {r_pad} into "
            f"chunks of at least 16, got {chunks}"
        )
    upcast, precision = dot_dtype_flags(latent_cache.dtype)
    part_out = part_lse = out  # unused placeholders when there is one split
    c_new, pe_new, slots = (q_lat, q_pe, seq_lens) if new_latents is None else new_latents
    if new_latents is not None:
        if c_new.shape[1] + pe_new.shape[1] != width or slots.shape[0] < rows:
            raise ValueError(
                f"new latents c_kv {tuple(c_new.shape)} / k_pe {tuple(pe_new.shape)} / "
                f"{slots.shape[0]} slots do not match a latent cache of width {width} and "
                f"{rows} token rows"
            )
        if c_new.dtype != latent_cache.dtype or pe_new.dtype != latent_cache.dtype:
            raise ValueError(
                f"new latents in {c_new.dtype} / {pe_new.dtype} for a {latent_cache.dtype} "
                f"latent cache: the decode writes them as they are"
            )
        assert c_new.stride(-1) == 1 and pe_new.stride(-1) == 1 and slots.dtype == torch.int64
    if splits > 1:
        part_out = split_scratch((rows, num_heads, splits, r_pad), q_lat.device, POISON_SCRATCH)
        part_lse = split_scratch((rows, num_heads, splits), q_lat.device, POISON_SCRATCH)
    grid = (triton.cdiv(query_len * num_heads, cfg["BLOCK_H"]), batch, splits)
    _mla_decode_split_kernel[grid](
        q_lat, q_pe, latent_cache, block_tables, seq_lens, out, part_out, part_lse,
        c_new, pe_new, slots, scale * 1.4426950408889634,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), c_new.stride(0), pe_new.stride(0),
        H=num_heads, R=r, R_PAD=r_pad, P=p, P_PAD=p_pad, PAGE=page, UPCAST=upcast,
        PRECISION=precision, INTERPRET=interpreting(), QLEN=query_len,
        QLEN_PAD=triton.next_power_of_2(query_len), NEW=new_latents is not None, **cfg,
        **pdl.launch_kwargs(q_lat),
    )  # fmt: skip
    if w_uv is not None and splits > 1 and rows <= MERGE_MAX_ROWS and env.mla_merge() == "fused":
        v = w_uv.shape[2]
        o = torch.empty(num_tokens, num_heads, v, dtype=q_lat.dtype, device=q_lat.device)
        if num_tokens > rows:
            o[rows:].zero_()
        return merge_w_uv(part_out, part_lse, w_uv, o, r)
    if splits > 1:
        merge_splits_kernel[(rows, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, S_PAD=triton.next_power_of_2(splits), HEAD_DIM=r, D_PAD=r_pad,
            num_warps=4,
            **pdl.launch_kwargs(part_out),
        )  # fmt: skip
    if w_uv is not None:
        return head_matmul_any_rows(out, w_uv)
    return out
