"""Linear layers. `MergedLinear` fuses several checkpoint projections into one matmul; the
loader writes each checkpoint tensor into its row slice (see `shard_offsets`). It is the
column-parallel linear of `parallel_linear` (the whole matrix at tensor-parallel size 1)."""

from __future__ import annotations

from deltaserve.layers.parallel_linear import ColumnParallelLinear

MergedLinear = ColumnParallelLinear

__all__ = ["MergedLinear"]
