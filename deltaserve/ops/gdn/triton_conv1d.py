"""Triton causal depthwise conv1d + SiLU for GDN layers, continuing from the conv-state pool.

Three kernels, all tiled over channels (conv_dim is large: 8192+):

- decode update (rows `0 .. num_decodes - 1`, one token each): the window is the slot's W - 1
  stored inputs plus the new one; the slot shifts by one in place. Reads no host lists, so a
  CUDA graph can capture it.
- decode update of q > 1 tokens per row (speculative verification; rows n * q .. n * q + q - 1):
  token t's tap j reads `[state | x_n][t + j]`, resolved at compile time (q and W are
  constants) to a state column or an input row; then the slot takes the last W - 1 entries of
  `[state | x_n]`. Also reads no host lists.
- varlen prefill (the sequences after the decodes): programs over (sequence, token block,
  channel block). Taps that reach before a sequence's first token read its slot (or zeros when
  `has_initial_state` is False: a masked load, so a NaN in a fresh slot is never read). The
  program of token block 0 also writes the slot's new window (the last W - 1 inputs of
  `[old | x]`) after a CTA barrier, so no program can read a window already overwritten.

conv_state is `[num_slots, conv_dim, W - 1]` (oldest input first); weight `[conv_dim, W]`, tap
W - 1 multiplies the newest input. Math in float32; output in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.forward_context import BatchMetadata
from deltaserve.ops import pdl
from deltaserve.ops.gdn import Conv1dBackend
from deltaserve.ops.specialize import INDEX_ARGS

MAX_WIDTH = 8


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def conv_shift_one(x_new, w_ptrs, s_ptrs, mask, stride_ww, stride_sw, W: tl.constexpr,
                   SYNC: tl.constexpr):  # fmt: skip
    """One token's causal conv + SiLU over a vector of channels: x_new [BC] (the new input in
    the activation dtype), tap j of each channel at w_ptrs + j * stride_ww, the slot's window
    (its last W - 1 inputs, oldest first) at s_ptrs + j * stride_sw, shifted by one in place.
    Returns silu(sum_j w_j * window_j) in float32, summed newest tap first, then the window's in
    order. SYNC: every window column is read, then a CTA barrier, then the shift is stored (a
    layout that repeats a channel in several warps, e.g. a GEMV's few output columns, would
    otherwise let one warp shift a column another has yet to read)."""
    acc = tl.load(w_ptrs + (W - 1) * stride_ww, mask=mask, other=0.0).to(tl.float32) * x_new.to(
        tl.float32
    )
    if SYNC:
        cols = ()
        for j in tl.static_range(W - 1):
            s_j = tl.load(s_ptrs + j * stride_sw, mask=mask, other=0.0)
            w_j = tl.load(w_ptrs + j * stride_ww, mask=mask, other=0.0).to(tl.float32)
            acc += w_j * s_j.to(tl.float32)
            cols = cols + (s_j,)
        tl.debug_barrier()
        for j in tl.static_range(1, W - 1):
            tl.store(s_ptrs + (j - 1) * stride_sw, cols[j], mask=mask)
    else:
        for j in tl.static_range(W - 1):
            s_j = tl.load(s_ptrs + j * stride_sw, mask=mask, other=0.0)
            w_j = tl.load(w_ptrs + j * stride_ww, mask=mask, other=0.0).to(tl.float32)
            acc += w_j * s_j.to(tl.float32)
            if j > 0:
                tl.store(s_ptrs + (j - 1) * stride_sw, s_j, mask=mask)
    tl.store(s_ptrs + (W - 2) * stride_sw, x_new.to(s_ptrs.dtype.element_ty), mask=mask)
    return _silu(acc)


@triton.jit
def conv_epilogue(y, offs_n, n_mask, C, w_ptr, state_ptr, slot_ptr, stride_wc, stride_ww,
                  stride_sn, stride_sc, stride_sw, W: tl.constexpr):  # fmt: skip
    """A one-row projection's output columns offs_n (y [BN], rounded to the activation dtype,
    as the projection would store it), whose columns below C are GDN's conv channels (the
    fused in_proj's [q | k | v] first): those become silu(conv) over the window of the slot at
    slot_ptr (one int64), which shifts in place; the others pass through. The conv decode's
    math (`conv_shift_one`), so the same bits as the projection then `conv1d_decode`."""
    is_conv = n_mask & (offs_n < C)
    slot = tl.load(slot_ptr).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_sn + offs_n * stride_sc
    w_ptrs = w_ptr + offs_n * stride_wc
    conv = conv_shift_one(y, w_ptrs, s_ptrs, is_conv, stride_ww, stride_sw, W, True)
    return tl.where(is_conv, conv.to(y.dtype), y)


@triton.jit
def _conv_decode_kernel(
    x_ptr,  # [N, C] (rows 0 .. N - 1 of the step's inputs)
    w_ptr,  # [C, W]
    state_ptr,  # [num_slots, C, W - 1], shifted in place
    slots_ptr,  # [N] int64
    out_ptr,  # [N, C]
    C,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_ww,
    stride_sn,
    stride_sc,
    stride_sw,
    stride_ot,
    stride_oc,
    W: tl.constexpr,
    BC: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (N, cdiv(C, BC)): one token's conv over BC channels; the window shifts by one."""
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)  # [BC]
    mask_c = offs_c < C
    slot = tl.load(slots_ptr + row).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_sn + offs_c * stride_sc  # [BC], column 0
    w_ptrs = w_ptr + offs_c * stride_wc
    x_new = tl.load(x_ptr + row * stride_xt + offs_c * stride_xc, mask=mask_c, other=0.0)
    # NOTE: each thread loads a column before it stores the column to its left, and the [BC]
    # tensors share one layout (one channel a thread), so the in-place shift needs no barrier.
    y = conv_shift_one(x_new, w_ptrs, s_ptrs, mask_c, stride_ww, stride_sw, W, False)
    tl.store(
        out_ptr + row * stride_ot + offs_c * stride_oc,
        y.to(out_ptr.dtype.element_ty),
        mask=mask_c,
    )


@triton.jit
def _conv_decode_multi_kernel(
    x_ptr,  # [N * QLEN, C]
    w_ptr,  # [C, W]
    state_ptr,  # [num_slots, C, W - 1], rewritten in place
    slots_ptr,  # [N] int64
    out_ptr,  # [N * QLEN, C]
    C,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_ww,
    stride_sn,
    stride_sc,
    stride_sw,
    stride_ot,
    stride_oc,
    W: tl.constexpr,
    QLEN: tl.constexpr,
    BC: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (N, cdiv(C, BC)): the QLEN tokens of decode row n over BC channels, in order."""
    pdl.wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)  # [BC]
    mask_c = offs_c < C
    slot = tl.load(slots_ptr + n).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_sn + offs_c * stride_sc  # [BC], column 0
    x_ptrs = x_ptr + (n * QLEN) * stride_xt + offs_c * stride_xc  # [BC], the row's token 0
    w_ptrs = w_ptr + offs_c * stride_wc

    # xpad = [state (W - 1 columns) | x (QLEN rows)]; token t's tap j reads xpad[t + j]
    for t in tl.static_range(QLEN):
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(W):
            w_j = tl.load(w_ptrs + j * stride_ww, mask=mask_c, other=0.0).to(tl.float32)
            if t + j < W - 1:
                x_j = tl.load(s_ptrs + (t + j) * stride_sw, mask=mask_c, other=0.0)
            else:
                x_j = tl.load(x_ptrs + (t + j - (W - 1)) * stride_xt, mask=mask_c, other=0.0)
            acc += w_j * x_j.to(tl.float32)
        tl.store(
            out_ptr + (n * QLEN + t) * stride_ot + offs_c * stride_oc,
            _silu(acc).to(out_ptr.dtype.element_ty),
            mask=mask_c,
        )
    # new state column j = xpad[QLEN + j]. NOTE: columns go in ascending order and column j reads
    # only column QLEN + j > j, which no earlier store touched; each thread reads a column before
    # it stores over it, and the [BC] tensors share one layout, so no barrier is needed.
    for j in tl.static_range(W - 1):
        if QLEN + j < W - 1:
            col = tl.load(s_ptrs + (QLEN + j) * stride_sw, mask=mask_c, other=0.0)
        else:
            col = tl.load(x_ptrs + (QLEN + j - (W - 1)) * stride_xt, mask=mask_c, other=0.0)
        tl.store(s_ptrs + j * stride_sw, col.to(state_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _window_column(
    x_ptr, s_base, dst_ptrs, start, col, offs_c, mask_c, has_init, stride_xt, stride_xc,
    stride_sw, W: tl.constexpr,
):  # fmt: skip
    """Store column `col` of xpad = [old window | x] (BC channels) at `dst_ptrs`: the old
    window's column while col < W - 1 (zeros without an initial state), else x[col - (W - 1)]."""
    from_old = col < W - 1
    old_col = tl.load(
        s_base + tl.minimum(col, W - 2) * stride_sw,
        mask=mask_c & from_old & has_init,
        other=0.0,
    )
    x_col = tl.load(
        x_ptr + (start + col - (W - 1)) * stride_xt + offs_c * stride_xc,
        mask=mask_c & (col >= W - 1),
        other=0.0,
    )
    new_col = tl.where(from_old, old_col.to(tl.float32), x_col.to(tl.float32))
    tl.store(dst_ptrs, new_col.to(dst_ptrs.dtype.element_ty), mask=mask_c)


@triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
def _conv_prefill_kernel(
    x_ptr,  # [Tp, C] the prefill rows
    w_ptr,  # [C, W]
    state_ptr,  # [num_slots, C, W - 1]
    slots_ptr,  # [P] int64
    has_init_ptr,  # [P] bool
    qsl_ptr,  # [P + 1] int32, from 0
    out_ptr,  # [Tp, C]
    ckpt_ptr,  # [P] int64: inputs after which to snapshot the window (0: none; CKPT only)
    ckpt_rows_ptr,  # [P] int64: the state row the snapshot goes to (CKPT only)
    C,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_ww,
    stride_sn,
    stride_sc,
    stride_sw,
    stride_ot,
    stride_oc,
    W: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    CKPT: tl.constexpr,  # the step takes in-step snapshots (ckpt_ptr / ckpt_rows_ptr are read)
):
    """Grid (P, cdiv(max_query_len, BT), cdiv(C, BC)): BT tokens x BC channels of one sequence.
    With CKPT, token block 0 of a sequence whose checkpoint h is > 0 also stores the window
    after its first h inputs (a prefix-cache snapshot at that boundary) to `ckpt_rows[seq]`."""
    seq = tl.program_id(0)
    t_block = tl.program_id(1)
    offs_c = tl.program_id(2) * BC + tl.arange(0, BC)  # [BC]
    start = tl.load(qsl_ptr + seq).to(tl.int64)
    length = tl.load(qsl_ptr + seq + 1).to(tl.int64) - start
    if t_block * BT >= length:
        return
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    has_init = tl.load(has_init_ptr + seq) != 0
    mask_c = offs_c < C
    s_base = state_ptr + slot * stride_sn + offs_c * stride_sc  # [BC], column 0

    offs_t = t_block * BT + tl.arange(0, BT)  # [BT] token index within the sequence
    mask_t = offs_t < length
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        # tap j reads xpad[t + j] = x[t + j - (W - 1)], or the old window where that is < 0
        src = offs_t + (j - (W - 1))  # [BT]
        in_x = mask_t & (src >= 0)
        x_j = tl.load(
            x_ptr + (start + src)[:, None] * stride_xt + offs_c[None, :] * stride_xc,
            mask=in_x[:, None] & mask_c[None, :],
            other=0.0,
        ).to(tl.float32)
        w_j = tl.load(w_ptr + offs_c * stride_wc + j * stride_ww, mask=mask_c, other=0.0)
        w_j = w_j.to(tl.float32)[None, :]  # [1, BC]
        acc += x_j * w_j
        if t_block == 0:  # only block 0 reaches back into the old window (BT >= W - 1)
            in_state = mask_t & (src < 0) & has_init
            old_j = tl.load(
                s_base[None, :] + (src + (W - 1))[:, None] * stride_sw,
                mask=in_state[:, None] & mask_c[None, :],
                other=0.0,
            )
            acc += old_j.to(tl.float32) * w_j
    out_ptrs = out_ptr + (start + offs_t)[:, None] * stride_ot + offs_c[None, :] * stride_oc
    tl.store(
        out_ptrs, _silu(acc).to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :]
    )

    if t_block == 0:
        if CKPT:
            # the window after h inputs, column j = xpad[h + j], read before the old window
            # is overwritten below; the snapshot row is no slot of this step
            ckpt = tl.load(ckpt_ptr + seq).to(tl.int64)
            c_base = state_ptr + tl.load(ckpt_rows_ptr + seq).to(tl.int64) * stride_sn
            c_base += offs_c * stride_sc
            for j in tl.static_range(W - 1):
                _window_column(
                    x_ptr, s_base, c_base + j * stride_sw, start, ckpt + j, offs_c,
                    mask_c & (ckpt > 0), has_init, stride_xt, stride_xc, stride_sw, W,
                )  # fmt: skip
        # new window column j = xpad[length + j]: old column length + j while that is < W - 1,
        # else x[length + j - (W - 1)]
        tl.debug_barrier()  # every thread of this program has read the old window
        for j in tl.static_range(W - 1):
            # NOTE: a column is read before any store can reach it: stores go to columns
            # < length + j
            _window_column(
                x_ptr, s_base, s_base + j * stride_sw, start, length + j, offs_c, mask_c,
                has_init, stride_xt, stride_xc, stride_sw, W,
            )  # fmt: skip


def conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    out: torch.Tensor | None = None,
    block_c: int | None = None,
    query_len: int = 1,
) -> torch.Tensor:
    """Decode update for N sequences of `query_len` (q) tokens: x [N * q, C] (any strides;
    sequence n owns rows n * q .. n * q + q - 1), weight [C, W], conv_state
    [num_slots, C, W - 1] updated in place at `state_slots` [N] int64 (its last W - 1 inputs).
    Writes silu(conv) into `out` [N * q, C] (allocated in x's dtype if None) and returns it;
    block_c overrides the channel tile (tests). q = 1 takes the one-token shift kernel."""
    rows, C = x.shape
    N = state_slots.shape[0]
    assert query_len >= 1 and rows == N * query_len, (rows, N, query_len)
    width = weight.shape[1]
    if out is None:
        out = torch.empty(rows, C, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    if query_len > 1:
        block_c = block_c or min(256, triton.next_power_of_2(C))
        _conv_decode_multi_kernel[(N, triton.cdiv(C, block_c))](
            x, weight, conv_state, state_slots, out, C,
            *x.stride(), *weight.stride(), *conv_state.stride(), *out.stride(),
            W=width, QLEN=query_len, BC=block_c, num_warps=8 if block_c >= 256 else 4,
            **pdl.launch_kwargs(x),
        )  # fmt: skip
        return out
    # H200, C=8192, W=4, bf16, in a CUDA graph: BC=256 with 8 warps was best at B=1, 64 and 512
    # (1.6 / 4.6 / 25 us); BC=512-1024 or fewer warps were up to 2x slower at B=512
    block_c = block_c or min(256, triton.next_power_of_2(C))
    _conv_decode_kernel[(N, triton.cdiv(C, block_c))](
        x,
        weight,
        conv_state,
        state_slots,
        out,
        C,
        *x.stride(),
        *weight.stride(),
        *conv_state.stride(),
        *out.stride(),
        W=width,
        BC=block_c,
        num_warps=8 if block_c >= 256 else 4,
        **pdl.launch_kwargs(x),
    )
    return out


def conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor | None = None,
    block_t: int | None = None,
    block_c: int | None = None,
    *,
    checkpoints: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Varlen causal conv over P sequences: x [Tp, C] (any strides; sequence p owns rows
    `query_start_loc[p] : [p + 1]`, from 0), weight [C, W], conv_state [num_slots, C, W - 1]
    read (where `has_initial_state`) and rewritten at `state_slots` [P]. Writes silu(conv) into
    `out` [Tp, C] (allocated in x's dtype if None); rows past the last sequence are untouched.
    block_t, block_c: override the tiling (tests). checkpoints: (heads [P], rows [P]) integer
    tensors: sequence p with heads[p] = h > 0 also stores its window after its first h inputs
    to `conv_state[rows[p]]` (a row no sequence of the call uses)."""
    Tp, C = x.shape
    width = weight.shape[1]
    if out is None:
        out = torch.empty(Tp, C, dtype=x.dtype, device=x.device)
    num_seqs = state_slots.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return out
    # NOTE: block_t >= W - 1, so only token block 0 reads the old window (which it rewrites)
    # H200, T=8192, C=8192, bf16: BT=32, BC=64 took 124 us (2.2 TB/s of x read + out written);
    # BT 16-64 x BC 64-256 ranged up to 3x slower
    block_t = block_t or min(32, max(8, triton.next_power_of_2(max_query_len)))
    block_c = block_c or min(64, triton.next_power_of_2(C))
    assert block_t >= width - 1
    grid = (num_seqs, triton.cdiv(max_query_len, block_t), triton.cdiv(C, block_c))
    _conv_prefill_kernel[grid](
        x,
        weight,
        conv_state,
        state_slots,
        has_initial_state,
        query_start_loc,
        out,
        *(checkpoints if checkpoints is not None else (state_slots, state_slots)),
        C,
        *x.stride(),
        *weight.stride(),
        *conv_state.stride(),
        *out.stride(),
        W=width,
        BT=block_t,
        BC=block_c,
        CKPT=checkpoints is not None,
        num_warps=4,
    )
    return out


class TritonConv1d(Conv1dBackend):
    """Decode rows (q tokens each) through `conv1d_decode`, the prefill part through
    `conv1d_prefill` (which takes a step's in-step snapshots inside the kernel)."""

    name = "triton"
    supports_cuda_graph = True
    takes_checkpoints = True

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        conv_state: torch.Tensor,
        meta: BatchMetadata,
    ) -> torch.Tensor:
        width = weight.shape[1]
        assert 2 <= width <= MAX_WIDTH, f"conv width {width} unsupported (2..{MAX_WIDTH})"
        assert conv_state.shape[1:] == (x.shape[1], width - 1), conv_state.shape
        T, C = x.shape
        nd, nt = meta.num_decodes, meta.num_decode_tokens  # decode rows, their token rows
        out = torch.empty(T, C, dtype=x.dtype, device=x.device)
        if nd:
            conv1d_decode(
                x[:nt],
                weight,
                conv_state,
                meta.state_slots[:nd],
                out=out[:nt],
                query_len=meta.decode_query_len,
            )
        part = meta.prefill_part()  # None when the batch is all decodes (the CUDA-graph case)
        end = nt
        if part is not None:
            end = part.token_offset + part.query_start_loc_cpu[-1]
            conv1d_prefill(
                x[nt:end],
                weight,
                conv_state,
                part.query_start_loc,
                part.state_slots,
                part.has_initial_state,
                part.max_query_len,
                out=out[nt:end],
                checkpoints=part.checkpoint_tensors(),
            )
        if end < T:  # rows past the batch are zero, as in the reference
            out[end:].zero_()
        return out
