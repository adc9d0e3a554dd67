"""Row copies inside state pools, every layer's pool tensors in one launch per row size.

A prefix-cache restore or snapshot copies one pool row (a sequence's recurrent state) to another
in each GDN layer's conv and SSM pools: 48 tensors at Qwen3.5-9B shapes, 2 MiB per SSM row.
`index_select` + `index_copy_` per tensor took 96 launches and ran at about 50-70 GB/s on an H200
(41 us + 29 us per 2 MiB row, torch.profiler). Here the pools' base addresses sit in a device
table (built on a set of tensors' first call and cached), and one program copies one block of
one row of one tensor: a launch per distinct row size, at copy bandwidth.

Semantics (as `reference.copy_rows`): for every tensor t, `t[dst[i]] = t[src[i]]` for all i, with
the copies independent (no row both read and written, no row written twice: the caller
guarantees it, cache/ops.py). Rows are copied as raw 4-, 2- or 1-byte words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # words per program


@triton.jit
def _copy_rows_kernel(
    bases_ptr,  # [num_tensors] int64: each pool tensor's address
    src_ptr,  # [C] int64 source rows
    dst_ptr,  # [C] int64 destination rows
    row_words,  # words per row (every tensor of the launch)
    WORD: tl.constexpr,  # bytes per word: 4, 2 or 1
    BLOCK: tl.constexpr,
):
    """Grid (num_tensors, C, cdiv(row_words, BLOCK))."""
    if WORD == 4:
        ty = tl.int32
    elif WORD == 2:
        ty = tl.int16
    else:
        ty = tl.int8
    base = tl.load(bases_ptr + tl.program_id(0)).to(tl.pointer_type(ty))
    src = tl.load(src_ptr + tl.program_id(1)).to(tl.int64)
    dst = tl.load(dst_ptr + tl.program_id(1)).to(tl.int64)
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < row_words
    x = tl.load(base + src * row_words + offs, mask=mask)
    tl.store(base + dst * row_words + offs, x, mask=mask)


class _Group:
    """Tensors of one row size: their address table on the device."""

    def __init__(self, tensors: list[torch.Tensor], row_bytes: int) -> None:
        self.word = 4 if row_bytes % 4 == 0 else 2 if row_bytes % 2 == 0 else 1
        self.row_words = row_bytes // self.word
        addresses = [t.data_ptr() for t in tensors]
        if any(a % self.word for a in addresses):
            self.word, self.row_words = 1, row_bytes
        self.bases = torch.tensor(addresses, dtype=torch.int64, device=tensors[0].device)
        self.num_tensors = len(tensors)


# NOTE: the tables hold addresses, not the tensors (an engine's pools are freed with it); a key
# names every tensor's address, shape and dtype, so a table is right for whatever tensors now
# sit there. A few engines per process at most: the cache is emptied past MAX_TABLES entries.
MAX_TABLES = 8
_tables: dict[tuple, list[_Group]] = {}


def _groups(tensors: list[torch.Tensor]) -> list[_Group]:
    key = tuple((t.data_ptr(), t.shape, t.dtype, t.device) for t in tensors)
    groups = _tables.get(key)
    if groups is None:
        if len(_tables) >= MAX_TABLES:
            _tables.clear()
        by_size: dict[int, list[torch.Tensor]] = {}
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError(f"copy_rows: pool tensors must be contiguous ({t.stride()})")
            by_size.setdefault(t[0].numel() * t.element_size(), []).append(t)
        groups = [_Group(ts, size) for size, ts in by_size.items()]
        _tables[key] = groups
    return groups


def copy_rows(tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """`t[dst[i]] = t[src[i]]` for every tensor t (contiguous, rows along dim 0) and every i;
    src / dst [C] int64 on the tensors' device; the copies independent (module docstring)."""
    if not tensors or src.numel() == 0:
        return
    for g in _groups(tensors):
        grid = (g.num_tensors, src.numel(), triton.cdiv(g.row_words, BLOCK))
        _copy_rows_kernel[grid](g.bases, src, dst, g.row_words, WORD=g.word, BLOCK=BLOCK)
