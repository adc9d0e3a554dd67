"""The small all-reduces of tensor parallelism (decode's [B, hidden] sums) in one kernel each:
PyTorch's one-shot all-reduce over symmetric memory, where every rank loads every peer's
buffer over NVLink peer-to-peer (no multicast) and sums in the same rank order.

Under NCCL, `all_reduce` sends a message of at most `max_bytes` here and anything larger (or of
another dtype, or not 16-byte aligned) to NCCL. The kernel copies the local input into this
rank's symmetric buffer, waits at a barrier for every peer's copy, sums the peers' buffers into
the output (the input itself: in place) and waits at a second barrier before the buffer may be
reused, so one buffer serves every call, in CUDA graphs too.

NOTE: on two H200s NCCL took 17 us per all-reduce of [1, 5120] bf16 inside a CUDA graph (129
of them, 2.2 ms of a 9.8 ms 27B decode step at TP=2): a latency that a one-kernel exchange
over NVLink avoids.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_MAX_BYTES = 1 << 20  # decode of up to 102 rows at hidden 5120, bf16
WORLD_SIZES = (2, 4, 8)  # those the kernel is built for


class SymmAllReduce:
    """One symmetric buffer of `max_bytes` on this rank's device, registered with every rank of
    `group` (a collective: every rank constructs it at the same point).

    NOTE: once per process. A second tensor-parallel engine in the same process (new workers)
    hung in this rendezvous on two H200s (torch 2.11): the rendezvous bookkeeping of the first
    group outlives it, so the new workers and rank 0 never meet. A later engine in the process
    runs NCCL and says why (parallel_state.setup_symm_all_reduce)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        dtype: torch.dtype,
        device: torch.device,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group)

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through the one-shot kernel (else NCCL)."""
        return (
            x.dtype == self.dtype
            and x.is_contiguous()
            and x.numel() <= self.max_numel
            and (x.numel() * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (x must be accepted)."""
        flat = x.view(-1)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            self.buffer[: flat.numel()], flat, "sum", self.group_name, flat
        )
        return x


def unavailable_reason(device: torch.device, backend: str | None, world: int) -> str | None:
    """Why this rank cannot use the one-shot all-reduce, or None."""
    if backend != "nccl" or device.type != "cuda":
        return "not an NCCL group on CUDA"
    if world not in WORLD_SIZES:
        return f"world size {world} (the kernel has {list(WORLD_SIZES)})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return f"torch {torch.__version__} lacks symm_mem.one_shot_all_reduce_copy_out"
    index = torch.cuda.current_device() if device.index is None else device.index
    for peer in range(world):  # rank r runs on cuda:r
        if peer != index and not torch.cuda.can_device_access_peer(index, peer):
            return f"no peer-to-peer access from cuda:{index} to cuda:{peer}"
    return None
