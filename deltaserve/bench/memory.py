"""Will a random-weight preset fit? Its weight bytes against the memory free on the device.

`deltaserve bench throughput --random-model NAME` builds the preset's model with random weights.
A preset too large for the device would otherwise die in the allocator, with a long traceback,
after minutes of initialisation: `check_random_model_fits` says so in one line first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_MEMINFO = Path("/proc/meminfo")


def available_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device`: the CUDA device's free memory, or the host's
    available memory (MemAvailable of /proc/meminfo, else the free physical pages); None when
    the platform does not say."""
    import torch

    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def random_model_bytes(name: str, dtype: torch.dtype) -> int:
    """Bytes of the weights of random preset `name` in `dtype` (parameters counted on the meta
    device: nothing is allocated)."""
    import torch

    from deltaserve.cache.spec import dtype_bytes
    from deltaserve.loader.random_model import random_model_config
    from deltaserve.models.registry import get_model_class

    hf, text, arch = random_model_config(name)
    vision = getattr(hf, "vision_config", None)
    extra = {"vision_config": vision} if vision is not None else {}
    with torch.device("meta"):
        model = get_model_class(arch)(text, tie_word_embeddings=hf.tie_word_embeddings, **extra)
    return sum(p.numel() for p in model.parameters()) * dtype_bytes(dtype)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def check_random_model_fits(
    name: str, dtype_name: str, device_name: str, tensor_parallel_size: int = 1
) -> None:
    """Raise ValueError (one line: the preset, the bytes it needs, the bytes free) when the
    weights of preset `name` alone cannot fit in the memory free on the device. With tensor
    parallelism each GPU holds a 1/N shard; on CPU every rank shares the host's memory."""
    from deltaserve.config import resolve_device, resolve_dtype

    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, None, device)
    total = random_model_bytes(name, dtype)
    per_device = total // tensor_parallel_size if device.type == "cuda" else total
    free = available_bytes(device)
    if free is None or per_device <= free:
        return
    where = "the GPU" if device.type == "cuda" else "this machine"
    dtype_text = str(dtype).removeprefix("torch.")
    shard = f" (1/{tensor_parallel_size} shard per GPU)" if per_device != total else ""
    if device.type == "cpu":
        hint = "try --random-model tiny-qwen3.5, a smaller --dtype, or --model DIR"
    else:
        hint = "try a smaller preset or --dtype, --tensor-parallel-size N, or --model DIR"
    raise ValueError(
        f"random model {name} does not fit in memory: its {dtype_text} weights need "
        f"{_gb(per_device)}{shard}, {where} has {_gb(free)} free ({hint})"
    )
