"""Tensor parallelism's all-reduce, residual add and RMSNorm in one Triton kernel, over
symmetric memory (deltaserve.distributed.symm_all_reduce owns the buffer).

At the end of a row-parallel block every rank holds a partial sum `x`; the decoder then adds
the sum over ranks to the residual stream and normalises it. Unfused, that is two kernels (the
one-shot all-reduce, with a barrier before and after its loads, then the add + norm); here one
program per row:

1. writes its row of `x` into this rank's symmetric buffer, in the half of the buffer the row's
   call count (its epoch) selects;
2. raises its flag on every peer (the epoch, stored with release semantics at system scope) and
   waits until every peer's flag on this rank reaches the epoch (acquire);
3. sums the row over the ranks in rank order in float32 (rounded to the activation dtype, as the
   all-reduce's output is), adds the residual (rounded, as the unfused add is), writes the new
   residual and the normalised row (`deltaserve.ops.fused.reference.rms_norm`'s math).

One barrier per call suffices: a row's two halves alternate, and a rank writes half h of row t
again only two calls later, after the flags of the call in between have shown that every peer
finished the call that read it (each rank's calls run in stream order). Epochs only grow (a
row's counter lives in this rank's memory and advances once per call of that row on every rank,
since every rank makes the same calls), so a flag is never reset and a late reader never sees a
stale value as current. The counters advance inside the kernel, so CUDA graph replays keep
counting.

Layout of the buffer (bytes from its base, the same on every rank): `data_offset` holds two
halves of `half_bytes` each (row t of half h at data_offset + h * half_bytes + t * row bytes);
`flag_offset` holds int64 flags [max_rows, world]: flag [t, p] on rank r is the last epoch peer
p announced for row t to rank r.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _wait_at_least(flag_ptr, epoch):
    """Spin until the int64 at `flag_ptr` (this rank's memory, written by a peer) >= epoch."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    while seen < epoch:
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _reduce_norm_kernel(
    x_ptr,  # [T, H] this rank's partial sums
    res_ptr,  # [T, H] the residual stream, overwritten with sum + residual
    w_ptr,  # [H]
    out_ptr,  # [T, H] the normalised rows
    bases_ptr,  # int64 [WORLD]: every rank's symmetric buffer address
    epoch_ptr,  # int64 [max_rows]: calls of each row so far on this rank
    rank,
    eps,
    stride_x,
    stride_r,
    stride_o,
    DATA_OFFSET: tl.constexpr,
    HALF_BYTES: tl.constexpr,
    FLAG_OFFSET: tl.constexpr,
    WORLD: tl.constexpr,
    H: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (T,): one row per program."""
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = x_ptr.dtype.element_ty
    row_bytes = H * x_ptr.dtype.element_ty.primitive_bitwidth // 8
    epoch = tl.load(epoch_ptr + t) + 1
    row_at = DATA_OFFSET + (epoch % 2) * HALF_BYTES + t * row_bytes  # byte offset, every rank
    x = tl.load(x_ptr + t.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
    mine = (tl.load(bases_ptr + rank) + row_at).to(tl.pointer_type(dtype))
    tl.store(mine + cols, x, mask=mask)
    # NOTE: every thread's stores land before the (single-thread) release of the flags below
    tl.debug_barrier()
    for p in tl.static_range(WORLD):
        if p != rank:
            peer_flags = (tl.load(bases_ptr + p) + FLAG_OFFSET).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer_flags + t * WORLD + rank, epoch, sem="release", scope="sys")
    my_flags = (tl.load(bases_ptr + rank) + FLAG_OFFSET).to(tl.pointer_type(tl.int64))
    for p in tl.static_range(WORLD):
        if p != rank:
            _wait_at_least(my_flags + t * WORLD + p, epoch)
    tl.debug_barrier()  # every thread reads the peers' rows after the acquire
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        src = (tl.load(bases_ptr + p) + row_at).to(tl.pointer_type(dtype))
        acc += tl.load(src + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
    total = acc.to(dtype)  # what the all-reduce returns
    r_ptr = res_ptr + t.to(tl.int64) * stride_r + cols
    r = (total.to(tl.float32) + tl.load(r_ptr, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(r_ptr, r, mask=mask)
    rf = r.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(rf * rf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = rf * rstd * (1.0 + w)
    else:
        y = w * (rf * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, y.to(dtype), mask=mask)
    tl.store(epoch_ptr + t, epoch)


def reduce_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    bases: torch.Tensor,
    epochs: torch.Tensor,
    rank: int,
    data_offset: int,
    half_bytes: int,
    flag_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum_ranks x + residual), residual) with `residual` updated in place; x [T, H]
    and residual [T, H] with unit last stride, weight [H]. Every rank calls this with the same
    T at the same point. `bases` int64 [world] (device): the symmetric buffers' addresses;
    `epochs` int64 [>= T] (device): this rank's per-row call counts; the offsets as in the
    module docstring (the caller checks that T rows fit a half and the flags)."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(hidden)
        _reduce_norm_kernel[(rows,)](
            x, residual, weight, out, bases, epochs, rank, eps,
            x.stride(0), residual.stride(0), out.stride(0),
            DATA_OFFSET=data_offset, HALF_BYTES=half_bytes, FLAG_OFFSET=flag_offset,
            WORLD=bases.numel(), H=hidden, ZERO_CENTERED=zero_centered, BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
    return out, residual
