"""Tokens sorted and aligned by expert, on the device, into buffers of a size fixed by the shapes
(so a step that runs it can be captured in a CUDA graph; no host sync anywhere).

The T * k (token, choice) pairs are numbered s = t * k + j. Each expert that receives pairs gets
a run of rows in `sorted_ids` padded up to a multiple of `block_m` (padding rows hold S = T * k,
an out-of-range pair); an expert that receives none gets no row. `block_expert[b]` is the expert
of rows b * block_m .. (b + 1) * block_m - 1 and `num_rows` [1] the number of rows used; the
grouped GEMM's programs past `num_rows` return at once.

Worst case: sum over experts of ceil(c_e / block_m) <= ceil(S / block_m) + min(E, S) blocks,
which is what `max_blocks` allocates (far below S + E * (block_m - 1) rows when S is small).

Two implementations with the same result, entry for entry: `align_by_expert_torch` (the
reference; ~15 launches, a radix sort among them: ~50 us a MoE layer at decode batch 64 on an
H200) and one Triton launch (`_align_kernel`, up to ALIGN_TRITON_MAX_PAIRS pairs: every decode
step and short prefill chunk; `align_by_expert` picks). Its grid has one program per expert and
one more: each program reads all S expert ids (ALIGN_BLOCK_S at a time), counts them per
expert (tl.histogram) and takes the padded counts' prefix sum, so every program knows every
run's start with no second launch; program e writes its own pairs (their rank within the
expert: a prefix sum of `id == e` over the pair ids, which keeps the pair order, as the stable
sort does) and its run's padding rows;
the last program writes `num_rows`, every block's expert (the searchsorted of the reference:
the experts whose run ends at or before the block's first row, clamped to E - 1) and the unused
rows past `num_rows`. Every entry of the three buffers is written: they come from torch.empty.
The sizes S and NB are runtime arguments, so one compile per (E, block_m) serves every batch
size and prefill chunk (a CUDA-graph capture over many batch sizes compiles it once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deltaserve.ops.linear import interpreting

# the most pairs the Triton alignment takes (every program reads all the ids, twice); larger
# calls (long prefill chunks, whose alignment cost is spread over their tokens) run the torch
# reference
ALIGN_TRITON_MAX_PAIRS = 8192
ALIGN_BLOCK_S = 1024  # pair ids each program reads at a time
ALIGN_TILE = 8192  # elements of the last program's [CHUNK, E_PAD] / [CHUNK, BLOCK_M] tiles


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the blocks the alignment can use (from shapes only)."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


@dataclass(frozen=True)
class AlignedPairs:
    """The pairs grouped by expert: `sorted_ids` [max_blocks * block_m] int32 (pair ids, S for
    padding), `block_expert` [max_blocks] int32, `num_rows` [1] int64, all on the device."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_rows: torch.Tensor
    block_m: int


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """topk_ids [T, k] (any integer dtype, ids in [0, E)) -> the pairs sorted by expert (stable:
    by pair id within an expert), each expert's run padded to a multiple of `block_m`: the
    Triton kernel on CUDA (and under the interpreter) up to ALIGN_TRITON_MAX_PAIRS pairs, else
    the torch reference (the same result)."""
    num_pairs = topk_ids.numel()
    use_triton = topk_ids.is_cuda or interpreting()
    if use_triton and 0 < num_pairs <= ALIGN_TRITON_MAX_PAIRS:
        return align_by_expert_triton(topk_ids, num_experts, block_m)
    return align_by_expert_torch(topk_ids, num_experts, block_m)


def align_by_expert_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """The reference alignment in torch (any device, any number of pairs)."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [S]
    num_pairs = flat.numel()
    nb = max_blocks(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)  # [E]
    pad_start = pad_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)  # [S] pair ids by expert
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=dev) - start[expert_of]  # place within its expert
    dest = pad_start[expert_of] + rank
    sorted_ids = torch.full((nb * block_m,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_first_row = torch.arange(nb, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, block_first_row, right=True)
    # NOTE: blocks past the used rows point one past the last expert: clamp (never read)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)
    return AlignedPairs(sorted_ids, block_expert, pad_end[-1:], block_m)


@triton.jit
def _align_kernel(
    ids_ptr,  # [S] expert id per pair (any integer dtype)
    sorted_ptr,  # [NB * BLOCK_M] int32 out
    block_expert_ptr,  # [NB] int32 out
    num_rows_ptr,  # [1] int64 out
    S,
    E,
    NB,
    E_PAD: tl.constexpr,  # next power of two >= E
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,  # pair ids read at a time
    CHUNK: tl.constexpr,  # blocks the last program handles at a time
):
    # NOTE: runtime loops are `while` loops (the interpreter cannot take `range` over a runtime
    # bound); S and NB are runtime values, so one compile serves every batch size
    e = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    s0 = 0
    while s0 < S:
        offs = s0 + tl.arange(0, BLOCK_S)
        ids = tl.load(ids_ptr + offs, mask=offs < S, other=0).to(tl.int32)  # [BLOCK_S]
        # masked lanes read expert 0: take them back out of its count
        masked = BLOCK_S - tl.minimum(S - s0, BLOCK_S)
        counts += tl.histogram(ids, E_PAD) - tl.where(experts == 0, masked, 0)
        s0 += BLOCK_S
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)  # [E_PAD] inclusive: where each expert's run ends
    total = tl.sum(padded, 0)
    if e < E:
        count = tl.sum(tl.where(experts == e, counts, 0), 0)
        run_end = tl.sum(tl.where(experts == e, pad_end, 0), 0)
        run_start = run_end - tl.sum(tl.where(experts == e, padded, 0), 0)
        placed = 0  # this expert's pairs among the ids before s0
        s0 = 0
        while s0 < S:
            offs = s0 + tl.arange(0, BLOCK_S)
            valid = offs < S
            ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
            mine = valid & (ids == e)
            rank = placed + tl.cumsum(mine.to(tl.int32), 0) - 1  # place within the run
            tl.store(sorted_ptr + run_start + rank, offs, mask=mine)
            placed += tl.sum(mine.to(tl.int32), 0)
            s0 += BLOCK_S
        pad_rows = run_start + count + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + pad_rows, S, mask=pad_rows < run_end)
    else:
        tl.store(num_rows_ptr, total.to(tl.int64))
        c = 0
        while c < NB:
            blocks = c + tl.arange(0, CHUNK)  # [CHUNK]
            first_row = blocks * BLOCK_M
            # searchsorted(pad_end, first_row, right=True): experts whose run ends by then
            ended = tl.sum((pad_end[None, :] <= first_row[:, None]).to(tl.int32), 1)
            owner = tl.minimum(ended, E - 1)
            tl.store(block_expert_ptr + blocks, owner, mask=blocks < NB)
            # the rows of blocks past the used ones: padding
            rows = first_row[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [CHUNK, BLOCK_M]
            tl.store(sorted_ptr + rows, S, mask=(blocks < NB)[:, None] & (rows >= total))
            c += CHUNK


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """`align_by_expert_torch`'s result in one Triton launch (1..ALIGN_TRITON_MAX_PAIRS pairs;
    CUDA, or CPU tensors under the interpreter)."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    if not 0 < num_pairs <= ALIGN_TRITON_MAX_PAIRS:
        raise ValueError(
            f"the Triton alignment takes 1..{ALIGN_TRITON_MAX_PAIRS} pairs, got {num_pairs}"
        )
    nb = max_blocks(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int64, device=dev)
    e_pad = max(2, triton.next_power_of_2(num_experts))
    # the last program's tiles: [CHUNK, E_PAD] comparisons, [CHUNK, BLOCK_M] rows
    chunk = max(1, ALIGN_TILE // max(e_pad, block_m))
    # sizes are runtime arguments: one compile per (E_PAD, block_m) serves every batch size
    _align_kernel[(num_experts + 1,)](
        flat, sorted_ids, block_expert, num_rows, num_pairs, num_experts, nb,
        E_PAD=e_pad, BLOCK_M=block_m, BLOCK_S=ALIGN_BLOCK_S, CHUNK=chunk, num_warps=4,
    )  # fmt: skip
    return AlignedPairs(sorted_ids, block_expert, num_rows, block_m)
