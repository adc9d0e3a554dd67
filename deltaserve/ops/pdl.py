"""Programmatic dependent launch (PDL) for our Triton kernels on Hopper and later.

Why: a decode step at batch 1 is hundreds of short kernels, and each one normally starts only
after the previous one has finished and its blocks have been dispatched afresh: the SMs idle
for the launch and the first loads of every kernel (a weight-streaming GEMM's first bytes
arrive about a microsecond after it starts). With PDL a kernel is launched while the previous
one still runs; its programs do what does not depend on that kernel (load their first tile of
weights, which no kernel of a step writes) and then wait at `griddepcontrol.wait` until the
previous kernel has completed and its writes are visible. So the launch and the first loads
overlap the previous kernel's tail.

The rules every kernel launched with `launch_kwargs` keeps (what makes it safe):
- before `wait` it reads only weights (never activations, caches or workspaces: the previous
  kernel may still be writing them) and writes nothing (a buffer it writes may be memory the
  previous kernel still reads, e.g. a tensor freed and reallocated by the caching allocator);
- every program calls `wait` (so the kernel completes only after its predecessor has: a later
  kernel's own wait then also covers every kernel before);
- `wait` is followed by `launch_dependents`, which lets the next kernel launch once every
  program of this one has passed its wait.
Kernels launched without PDL (PyTorch's, cuBLAS) keep the stream's ordinary full ordering.

DELTASERVE_PDL=0 turns it off; it is also off under the Triton interpreter, on CPU and below
compute capability 9.0 (there the `PDL` constexpr is False and the kernels compile as before).
CUDA-graph capture records the programmatic edges, so replays keep the overlap.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deltaserve import env


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _off_reason(device: torch.device) -> str | None:
    """Why kernels launched on `device` do not use PDL, or None where they do."""
    if device.type != "cuda":
        return f"{device.type} device"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "Triton interpreter"
    if env.pdl() == "off":
        return "DELTASERVE_PDL=0"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _capable(index):
        major, minor = torch.cuda.get_device_capability(index)
        return f"compute capability {major}.{minor} < 9.0"
    return None


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on `device` use PDL (see the module docstring)."""
    return _off_reason(device) is None


def describe(device: torch.device) -> str:
    """One start-up log line: whether PDL is on for `device`, and why not where it is off."""
    reason = _off_reason(device)
    if reason is None:
        return "programmatic dependent launch: on (Triton decode kernels; DELTASERVE_PDL=0: off)"
    return f"programmatic dependent launch: off ({reason})"


def launch_kwargs(t: torch.Tensor) -> dict:
    """The keyword arguments of a launch on t's device: {"PDL": True, "launch_pdl": True} where
    PDL is on, else {"PDL": False} (the kernel's `PDL` constexpr; `launch_pdl` is Triton's
    launch option that sets the programmatic-serialization attribute)."""
    if enabled(t.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the previous kernel has completed (its writes visible), then let the next
    kernel launch. A no-op when PDL is False."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
