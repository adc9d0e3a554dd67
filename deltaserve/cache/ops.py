"""Cache operations a scheduled batch carries, applied to the cache tensors before its forward.

The scheduler decides them on integer ids (bookkeeping stays off the device); the model runner
calls `apply_cache_ops` with the batch's `cache_ops` before running the model, on every
tensor-parallel rank (ids mean the same on each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.cache.spec import CacheSpec
from deltaserve.forward_context import LayerCache
from deltaserve.host_copy import to_device_async
from deltaserve.ops.fused import FusedOps, reference


@dataclass(frozen=True)
class CopySlot:
    """Copy state slot `src` to slot `dst` in every "slots"-pool tensor of every layer (e.g. a
    recurrent-state snapshot before a speculative step, or restoring one after a rejection)."""

    src: int
    dst: int


@dataclass(frozen=True)
class TruncateBlocks:
    """Sequence `seq_id` now has only `num_tokens` tokens (rejected drafts rolled back); the
    scheduler has already released its blocks past them.

    NOTE: the tensors need nothing: KV entries past a sequence's length are never read, and
    freed blocks are overwritten before any sequence reads them. The op tells the runner (and
    anything mirroring block tables) that the sequence's block list shrank."""

    seq_id: int
    num_tokens: int


CacheOp = CopySlot | TruncateBlocks


@torch.no_grad()
def apply_cache_ops(
    ops: list[CacheOp],
    specs: list[CacheSpec],
    caches: list[LayerCache],
    fused: FusedOps | None = None,
) -> None:
    """Apply `ops`, in order, to the layers' caches (`specs[i]` describes `caches[i]`).

    Consecutive copies that do not depend on each other (none reads a row an earlier one of
    the run writes, no row written twice) run together: `fused.copy_rows` over every "slots"
    pool tensor (the Triton one: one launch per row size), by default the torch reference."""
    run: list[CopySlot] = []
    for op in ops:
        if isinstance(op, CopySlot):
            if op.src == op.dst:
                continue
            written = {c.dst for c in run}
            if op.src in written or op.dst in written:
                _copy_rows(run, specs, caches, fused)
                run = []
            run.append(op)
        elif isinstance(op, TruncateBlocks):
            continue  # bookkeeping only (see TruncateBlocks)
        else:
            raise TypeError(f"unknown cache op {op!r}")
    _copy_rows(run, specs, caches, fused)


def _copy_rows(
    copies: list[CopySlot],
    specs: list[CacheSpec],
    caches: list[LayerCache],
    fused: FusedOps | None,
) -> None:
    """Row dst <- row src of every "slots"-pool tensor, for independent copies."""
    tensors = [
        t for s, c in zip(specs, caches, strict=True) if s.pool == "slots" for t in c.values()
    ]
    if not copies or not tensors:
        return
    # the rows as one host tensor [src..., dst...], copied without waiting for the device
    rows = torch.tensor([c.src for c in copies] + [c.dst for c in copies], dtype=torch.int64)
    src, dst = to_device_async(rows, tensors[0].device).split(len(copies))
    copy = reference.copy_rows if fused is None else fused.copy_rows
    copy(tensors, src, dst)
