"""Arrival counters for kernels whose last program of a tile finishes the tile (split-K sums,
the MoE decode path's top-k sum), in one launch with no memset.

Every program of a tile stores its part, then atomically increments the tile's counter; the
program that sees count == parts - 1 is the last: it reads the parts (in a fixed order, so the
result does not depend on which program that is), writes the result and sets the counter back
to 0. The counters are therefore 0 between calls, and a CUDA-graph replay needs no reset.

One buffer per (purpose, device, owner tensor address, size): kernels on one stream run one at
a time, and no two streams run the same layer's kernel at once, so calls never share a counter
while it is non-zero.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[str, str, int, int], torch.Tensor] = {}


def arrival_counters(purpose: str, owner: torch.Tensor, size: int) -> torch.Tensor:
    """int32 [size] zeros, the same buffer for every call with the same purpose, owner
    (a weight: its device and address) and size.

    NOTE: allocated on the first call for an owner, which must not be inside a CUDA-graph
    capture (the engine's warm-up runs each kernel eagerly first, as Triton's compile and
    autotuning need anyway)."""
    key = (purpose, str(owner.device), owner.data_ptr(), size)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = torch.zeros(size, dtype=torch.int32, device=owner.device)
        _COUNTERS[key] = buf
    return buf


def all_counters() -> list[torch.Tensor]:
    """Every counter buffer (tests check they are back at 0)."""
    return list(_COUNTERS.values())
