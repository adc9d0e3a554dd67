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


def kv_head_replicas(num_kv_heads: int, tp: int) -> int:
    """How many ranks hold each attention kv head: 1 when tp divides the kv heads (each rank
    its own num_kv_heads // tp), tp // num_kv_heads when the kv heads divide tp (fewer kv
    heads than ranks: each rank holds the one kv head its query heads read); a ValueError
    naming both counts otherwise."""
    if num_kv_heads % tp == 0:
        return 1
    if tp % num_kv_heads == 0:
        return tp // num_kv_heads
    raise ValueError(
        f"tensor_parallel_size={tp} and num_key_value_heads ({num_kv_heads}): one must divide "
        "the other (each rank holds num_kv_heads / tp kv heads, or one kv head shared by "
        "tp / num_kv_heads ranks); pick a size that does"
    )


@dataclass(frozen=True)
class ShardRule:
    """Split dimension `dim` of a checkpoint tensor made of `pieces` (global sizes, in order).
    A negative `dim` counts from the end, so one rule fits a tensor of one expert and the same
    tensor stacked over experts.

    With `pad` (one piece only: a vocabulary), each rank holds cdiv(size, tp) rows and the last
    rank(s) get fewer real rows; the rest of their shard is padding the loader zeroes.

    With `replicas` > 1 each part is held by that many consecutive ranks: the pieces are split
    into tp // replicas parts and rank r holds part r // replicas (kv heads shared by ranks).
    """

    dim: int
    pieces: tuple[int, ...]
    pad: bool = False
    replicas: int = 1

    @property
    def global_size(self) -> int:
        return sum(self.pieces)

    def local_size(self, tp: int) -> int:
        if self.pad:
            return cdiv(self.pieces[0], tp)
        return sum(p // self._parts(tp) for p in self.pieces)

    def _parts(self, tp: int) -> int:
        if tp % self.replicas:
            raise ValueError(f"{self.replicas} replicas do not divide tensor_parallel_size={tp}")
        return tp // self.replicas

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
        part = rank // self.replicas
        for p in self.pieces:
            n = p // self._parts(tp)
            parts.append(tensor.narrow(self.dim, offset + part * n, n))
            offset += p
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def check_tp_shapes(text_config: Any, tp: int) -> None:
    """Fail at start-up, with the count that does not divide, when `tp` cannot split the model:
    attention q heads, kv heads (unless they divide tp: kv_head_replicas), GDN key and value
    heads, the MLP's intermediate size, a MoE model's expert and shared-expert widths."""
    if tp == 1:
        return
    for attr, what in (
        ("num_attention_heads", "attention query heads"),
        ("linear_num_key_heads", "GDN key heads"),
        ("linear_num_value_heads", "GDN value heads"),
        ("intermediate_size", "MLP width"),
        ("moe_intermediate_size", "MoE expert width"),
        ("shared_expert_intermediate_size", "shared expert width"),
    ):
        n = getattr(text_config, attr, None)
        if isinstance(n, int):
            divide(n, tp, attr, what)
    kv = getattr(text_config, "num_key_value_heads", None)
    if isinstance(kv, int):
        kv_head_replicas(kv, tp)
