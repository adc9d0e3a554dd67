"""Linear layers. `MergedLinear` fuses several checkpoint projections into one matmul; the
loader writes each checkpoint tensor into its row slice (see `shard_offsets`)."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One nn.Linear whose output rows are the concatenation of named shards.

    `shards` maps each checkpoint sub-module name (e.g. "q_proj") to its output size, in order.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Split the fused output [.., sum] back into its shards (views)."""
        return list(torch.split(y, [s for _, s in self.shard_offsets.values()], dim=-1))
