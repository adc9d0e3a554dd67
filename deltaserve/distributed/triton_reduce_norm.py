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

Layout of the buffer (the same on every rank): a data region of two halves (row t of half h
at element h * half + t * H of the region); at `flag_offset` bytes from the buffer's base,
int64 flags [max_rows, world]: flag [t, p] on rank r is the last epoch peer p announced for
row t to rank r.

NOTE: a first version read the peers' rows through pointers made from their integer
addresses: Triton then assumes no alignment and issued 2-byte loads over NVLink, 15 us a call
on two H200s (27B shapes, batch 1) against 6.6 us for PyTorch's one-shot all-reduce alone.
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
def _peer(p: tl.constexpr, d0, d1, d2, d3, d4, d5, d6, d7):
    """The data pointer of rank p (p a constexpr: the static loops below unroll)."""
    if p == 0:
        return d0
    elif p == 1:
        return d1
    elif p == 2:
        return d2
    elif p == 3:
        return d3
    elif p == 4:
        return d4
    elif p == 5:
        return d5
    elif p == 6:
        return d6
    else:
        return d7


@triton.jit
def _reduce_norm_kernel(
    x_ptr,  # [T, H] this rank's partial sums
    res_ptr,  # [T, H] the residual stream, overwritten with sum + residual
    w_ptr,  # [H]
    out_ptr,  # [T, H] the normalised rows
    mine_ptr,  # this rank's data region (two halves of rows), x's dtype
    d0,  # rank 0's data region (as mapped here), ... d7: rank 7's (unused ones repeat d0)
    d1,
    d2,
    d3,
    d4,
    d5,
    d6,
    d7,
    bases_ptr,  # int64 [WORLD]: every rank's symmetric buffer address (for the flags)
    epoch_ptr,  # int64 [max_rows]: calls of each row so far on this rank
    rank,
    eps,
    stride_x,
    stride_r,
    stride_o,
    HALF: tl.constexpr,  # elements of one half
    FLAG_OFFSET: tl.constexpr,
    WORLD: tl.constexpr,
    H: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (T,): one row per program. The rows move through pointer arguments (tensors over
    each rank's buffer), so their loads and stores are 16-byte vectors; pointers made from the
    integer addresses would be assumed unaligned."""
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = x_ptr.dtype.element_ty
    epoch = tl.load(epoch_ptr + t) + 1
    row_at = (epoch % 2) * HALF + t * H  # elements into a data region, the same on every rank
    x = tl.load(x_ptr + t.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
    tl.store(mine_ptr + row_at + cols, x, mask=mask)
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
        src = _peer(p, d0, d1, d2, d3, d4, d5, d6, d7) + row_at
        # .cg: from L2 / the peer, never a stale L1 line of an earlier call
        acc += tl.load(src + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
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
    regions: list[torch.Tensor],
    bases: torch.Tensor,
    epochs: torch.Tensor,
    rank: int,
    flag_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum_ranks x + residual), residual) with `residual` updated in place; x [T, H]
    and residual [T, H] with unit last stride, weight [H]. Every rank calls this with the same
    T at the same point. `regions`: every rank's data region (two halves of equal size) as a
    1-D tensor of x's dtype mapped on this device, in rank order; `bases` int64 [world]
    (device): the symmetric buffers' addresses (the flags live at `flag_offset` bytes from
    them); `epochs` int64 [>= T] (device): this rank's per-row call counts (the caller checks
    that T rows fit a half and the flags)."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    world = len(regions)
    if rows:
        block = triton.next_power_of_2(hidden)
        peers = regions + [regions[0]] * (8 - world)
        _reduce_norm_kernel[(rows,)](
            x, residual, weight, out, regions[rank], *peers, bases, epochs, rank, eps,
            x.stride(0), residual.stride(0), out.stride(0),
            HALF=regions[0].numel() // 2, FLAG_OFFSET=flag_offset, WORLD=world, H=hidden,
            ZERO_CENTERED=zero_centered, BLOCK=block, num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
    return out, residual
