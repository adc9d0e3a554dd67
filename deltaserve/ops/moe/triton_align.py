"""Tokens sorted and aligned by expert, on the device, into buffers of a size fixed by the shapes
(so a step that runs it can be captured in a CUDA graph; no host sync anywhere).

The T * k (token, choice) pairs are numbered s = t * k + j. Each expert that receives pairs gets
a run of rows in `sorted_ids` padded up to a multiple of `block_m` (padding rows hold S = T * k,
an out-of-range pair); an expert that receives none gets no row. `block_expert[b]` is the expert
of rows b * block_m .. (b + 1) * block_m - 1 and `num_rows` [1] the number of rows used; the
grouped GEMM's programs past `num_rows` return at once.

Worst case: sum over experts of ceil(c_e / block_m) <= ceil(S / block_m) + min(E, S) blocks,
which is what `max_blocks` allocates (far below S + E * (block_m - 1) rows when S is small).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """topk_ids [T, k] (any integer dtype) -> the pairs sorted by expert (stable: by pair id
    within an expert), each expert's run padded to a multiple of `block_m`."""
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
