"""The small all-reduces of tensor parallelism (decode's [B, hidden] sums) in one kernel each:
PyTorch's one-shot all-reduce over symmetric memory, where every rank loads every peer's
buffer over NVLink peer-to-peer (no multicast) and sums in the same rank order.

Under NCCL, `all_reduce` sends a message of at most `max_bytes` here and anything larger (or of
another dtype, or not 16-byte aligned) to NCCL. The kernel copies the local input into this
rank's symmetric buffer, waits at a barrier for every peer's copy, sums the peers' buffers into
the output (the input itself: in place) and waits at a second barrier before the buffer may be
reused, so one buffer serves every call, in CUDA graphs too.

The same buffer serves the all-reduce fused with the residual add and RMSNorm that follow a
row-parallel block (deltaserve.distributed.triton_reduce_norm: one kernel, one barrier), which
the decoder stack uses where every block of its layers can leave its sum to the next norm
(deltaserve.layers.decoder).

NOTE: on two H200s NCCL took 17 us per all-reduce of [1, 5120] bf16 inside a CUDA graph (129
of them, 2.2 ms of a 9.8 ms 27B decode step at TP=2): a latency that a one-kernel exchange
over NVLink avoids.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_MAX_BYTES = 1 << 20  # decode of up to 102 rows at hidden 5120, bf16
WORLD_SIZES = (2, 4, 8)  # those the kernel is built for


FLAG_ROWS = 1024  # rows the fused kernel's flags and counters are sized for


class SymmAllReduce:
    """One symmetric buffer on this rank's device, registered with every rank of `group` (a
    collective: every rank constructs it at the same point), serving two kernels:

    - the one-shot all-reduce of messages of at most `max_bytes` (its first `max_bytes`);
    - the all-reduce fused with the residual add and RMSNorm that follows a row-parallel block
      (deltaserve.distributed.triton_reduce_norm: two halves of `max_bytes` for the rows, then
      int64 flags [FLAG_ROWS, world]), when `fused` is asked for.

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
        fused: bool = True,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.max_bytes = max_bytes
        self.max_numel = max_bytes // dtype.itemsize
        self.group_name = group.group_name
        self.rank = group.rank()
        self.world = group.size()
        self.fused = fused
        self.data_offset = max_bytes  # the fused kernel's two halves
        self.flag_offset = 3 * max_bytes
        total = self.flag_offset + FLAG_ROWS * self.world * 8
        raw = symm_mem.empty(total, dtype=torch.uint8, device=device)
        raw[self.flag_offset :].zero_()  # no peer may signal before every rank has zeroed
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(raw, group)
        self.buffer = raw[:max_bytes].view(dtype)  # the one-shot kernel's
        shift = raw.data_ptr() - handle.buffer_ptrs[self.rank]  # the tensor within its allocation
        bases = [ptr + shift for ptr in handle.buffer_ptrs]
        self.bases = torch.tensor(bases, dtype=torch.int64, device=device)
        # every rank's data region (two halves of max_bytes) as a tensor mapped here
        self.regions = [
            handle.get_buffer(
                p, (2 * self.max_numel,), dtype, (shift + self.data_offset) // dtype.itemsize
            )
            for p in range(self.world)
        ]
        self.epochs = torch.zeros(FLAG_ROWS, dtype=torch.int64, device=device)
        dist.barrier(group=group)  # every rank's flags are zero before any kernel runs

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

    def fuses(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether all-reduce + add + norm of x [T, H] runs in the fused kernel (else the
        one-shot or NCCL all-reduce, then the norm)."""
        return (
            self.fused
            and x.dim() == 2
            and x.dtype == self.dtype
            and residual.shape == x.shape
            and residual.dtype == x.dtype
            and x.stride(-1) == 1
            and residual.stride(-1) == 1
            and x.shape[0] <= FLAG_ROWS
            and x.numel() * x.element_size() <= self.max_bytes
        )

    def reduce_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        zero_centered: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum over ranks of x + residual), residual updated in place), in one kernel
        (x must be fused: `fuses`)."""
        from deltaserve.distributed.triton_reduce_norm import reduce_rms_norm

        return reduce_rms_norm(
            x, residual, weight, eps, zero_centered, self.regions, self.bases, self.epochs,
            self.rank, self.flag_offset,
        )  # fmt: skip


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
