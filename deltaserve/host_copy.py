"""Host-to-device copies that do not wait for the GPU.

Why: a copy from pageable host memory may wait for the stream, i.e. for the GPU to finish the
work queued before it. With overlapped (asynchronous) scheduling the host prepares step k + 1
while the GPU runs step k, so such a wait stalls the host once per step. From page-locked memory
the copy is truly asynchronous; PyTorch's pinned allocator keeps the block until the copy that
reads it has run.
"""

from __future__ import annotations

import torch


def pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` in page-locked memory where it is bound for a CUDA `device` (for a library that
    copies it there itself, e.g. FlashInfer's plan), else `host` unchanged."""
    return host.pin_memory() if device.type == "cuda" else host


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` without a host sync: on CUDA through pinned memory with an
    asynchronous copy; on CPU `host` itself."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
