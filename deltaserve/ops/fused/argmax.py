"""Row argmax of a logits matrix: the sampler's last op (greedy rows, and the exponential race
of sampled rows).

Why: torch's argmax over one row of a vocabulary-wide matrix runs in one thread block (a
`reduce_kernel<512, 1>`: 23.5 us per decode step for DeepSeek-V2-Lite's 102,400 logits at
batch 1 on an H200, docs/results/profile-dsv2-lite-b1-no-pdl-h200.txt; about 1% of the step).
Here the row is split into chunks of CHUNK logits, one program each (the max and its first
index per chunk), and a second launch keeps, per row, the first chunk holding the row's max.
Together they return torch's answer: the index of the first maximum of each row.

NaN: torch ranks NaN above every number; here a NaN counts as +inf, so a row holding both
+inf and a later NaN gets the +inf's index where torch gives the NaN's (logits with NaN are a
fault upstream either way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # logits per program of the first pass


@triton.jit
def _chunk_max_kernel(x_ptr, vals_ptr, idx_ptr, V, stride_x, CHUNK: tl.constexpr):
    """Grid (R, cdiv(V, CHUNK)): vals / idx [R, chunks] = each chunk's max and its first index
    (row-wide)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V, other=float("-inf"))
    v = v.to(tl.float32)
    v = tl.where(v != v, float("inf"), v)  # NaN: +inf (see the module docstring)
    # ties go to the lower index; the masked tail (-inf) lies past every real logit
    best, at = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
    chunks = tl.num_programs(1)
    tl.store(vals_ptr + row * chunks + c, best)
    tl.store(idx_ptr + row * chunks + c, (c * CHUNK + at).to(tl.int64))


@triton.jit
def _pick_chunk_kernel(vals_ptr, idx_ptr, out_ptr, chunks, CHUNKS_PAD: tl.constexpr):
    """Grid (R,): out[r] = idx[r, j] for the first chunk j holding row r's max."""
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS_PAD)
    v = tl.load(vals_ptr + row * chunks + offs, mask=offs < chunks, other=float("-inf"))
    # every chunk's max is at least -inf: a masked pad never wins over chunk 0 (ties go left)
    _, j = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * chunks + j))


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] (unit last stride, any float dtype) -> [R] int64: the index of each row's first
    maximum (torch.argmax(x, dim=-1); NaN as +inf). Two launches, no host sync."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"row_argmax takes [R, V] with a unit last stride, got {tuple(x.shape)}")
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("row_argmax of an empty row")
    chunks = triton.cdiv(vocab, CHUNK)
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int64, device=x.device)
    _chunk_max_kernel[(rows, chunks)](x, vals, idx, vocab, x.stride(0), CHUNK=CHUNK, num_warps=8)
    pad = max(16, triton.next_power_of_2(chunks))
    _pick_chunk_kernel[(rows,)](vals, idx, out, chunks, CHUNKS_PAD=pad, num_warps=1)
    return out
