"""How a checkpoint tensor is cut into tensor-parallel shards, and the divisibility checks.

A `ShardRule` says which dimension of a parameter is split across ranks and how that dimension
is made of consecutive *pieces* (e.g. GDN's in_proj_qkv rows are [q | k | v]); every piece is
split evenly and a rank's shard is its part of each piece, concatenated. The loader slices each
checkpoint tensor with its rule; the model only sees the rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def divide(n: int, tp: int, name: str, what: str = "") -> int:
    """n // tp, or a ValueError naming the count (`name`, e.g. a config field) when tp does not
    divide it; `what` says what the count is."""
    if n % tp:
        about = f" ({what})" if what else ""
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide {name} ({n}){about}: every rank must "
            "hold the same number; pick a size that divides it"
        )
    return n // tp


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ShardRule:
    """Split dimension `dim` of a checkpoint tensor made of `pieces` (global sizes, in order).
    A negative `dim` counts from the end, so one rule fits a tensor of one expert and the same
    tensor stacked over experts.

    With `pad` (one piece only: a vocabulary), each rank holds cdiv(size, tp) rows and the last
    rank(s) get fewer real rows; the rest of their shard is padding the loader zeroes.
    """

    dim: int
    pieces: tuple[int, ...]
    pad: bool = False

    @property
    def global_size(self) -> int:
        return sum(self.pieces)

    def local_size(self, tp: int) -> int:
        if self.pad:
            return cdiv(self.pieces[0], tp)
        return sum(p // tp for p in self.pieces)

    def local_range(self, rank: int, tp: int) -> tuple[int, int]:
        """[start, end) of the real (unpadded) rows this rank owns, for a padded rule."""
        per = cdiv(self.pieces[0], tp)
        start = min(rank * per, self.pieces[0])
        return start, min(start + per, self.pieces[0])

    def slice(self, tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """This rank's part of a checkpoint tensor whose `dim` has `global_size` entries."""
        if tp == 1:
            return tensor
        if self.pad:
            start, end = self.local_range(rank, tp)
            return tensor.narrow(self.dim, start, end - start)
        parts, offset = [], 0
        for p in self.pieces:
            n = p // tp
            parts.append(tensor.narrow(self.dim, offset + rank * n, n))
            offset += p
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def check_tp_shapes(text_config: Any, tp: int) -> None:
    """Fail at start-up, with the count that does not divide, when `tp` cannot split the model:
    attention q and kv heads, GDN key and value heads, the MLP's intermediate size, a MoE
    model's expert and shared-expert widths."""
    if tp == 1:
        return
    for attr, what in (
        ("num_attention_heads", "attention query heads"),
        ("num_key_value_heads", "attention kv heads"),
        ("linear_num_key_heads", "GDN key heads"),
        ("linear_num_value_heads", "GDN value heads"),
        ("intermediate_size", "MLP width"),
        ("moe_intermediate_size", "MoE expert width"),
        ("shared_expert_intermediate_size", "shared expert width"),
    ):
        n = getattr(text_config, attr, None)
        if isinstance(n, int):
            divide(n, tp, attr, what)
