"""Timing tensor parallelism's communication, run by every rank together (`deltaserve bench`).

Rank 0 sends a task through the control channel (`run_on_all_ranks`); each worker runs the same
task from its step loop (deltaserve.distributed.worker), so the collectives inside pair up.

- `AllReduceStep`: the all-reduces of one decode step: `count` all-reduces of [rows, hidden] in
  the model's dtype, through the path the engine takes (those at norms fused with the residual
  add and RMSNorm where that kernel is installed), captured in one CUDA graph as the decode
  graphs hold them and timed with CUDA events per replay (on CPU: gloo, eager, wall clock).
- `ControlMessage`: one step description (a `StepInput`) sent over the gloo control group, the
  way rank 0 sends one per step: pickling included, timed on rank 0's clock.

The median over `repeats` runs is rank 0's result; the workers' own timings are dropped.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.distributed.parallel_state import (
    all_reduce,
    all_reduce_rms_norm,
    broadcast_object,
    fused_norm_installed,
    new_cuda_graph,
    small_all_reduce_installed,
    tp_rank,
    tp_size,
)
from deltaserve.ops.fused.reference import rms_norm


class WorkerTask:
    """A message rank 0 broadcasts instead of a step: every rank runs `run(device)` (rank 0's
    return value is the result)."""

    def run(self, device: torch.device) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class AllReduceStep(WorkerTask):
    rows: int
    hidden: int
    dtype: torch.dtype
    count: int  # all-reduces per decode step
    repeats: int = 20
    warmup: int = 3
    small_kernel: bool = True  # False: NCCL even where the one-shot kernel is installed
    # of the `count`, those that end a block whose sum the next norm takes: run fused with the
    # residual add and RMSNorm where that kernel is installed (and small_kernel)
    at_norms: int = 0

    def run(self, device: torch.device) -> float:
        """Median seconds of `count` all-reduces of [rows, hidden]."""
        # NOTE: every all-reduce multiplies the values by the world size, so they may overflow
        # to inf: NCCL's time does not depend on the values
        x = torch.randn(self.rows, self.hidden, device=device).to(self.dtype)
        fused = self.at_norms if self.small_kernel and fused_norm_installed() else 0
        residual, weight = torch.zeros_like(x), torch.ones(self.hidden, device=device)
        weight = weight.to(self.dtype)

        def step() -> None:
            for _ in range(fused):
                all_reduce_rms_norm(x, residual, weight, 1e-6, False, rms_norm)
            for _ in range(self.count - fused):
                all_reduce(x, small_kernel=self.small_kernel)

        if device.type != "cuda":
            times = []
            for i in range(self.warmup + self.repeats):
                start = time.perf_counter()
                step()
                if i >= self.warmup:
                    times.append(time.perf_counter() - start)
            return statistics.median(times)
        step()  # the communicator exists before capture
        torch.cuda.synchronize(device)
        graph = new_cuda_graph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step()
        times = []
        for i in range(self.warmup + self.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if i >= self.warmup:
                times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)


@dataclass(frozen=True)
class AllReduceAgreement(WorkerTask):
    """The one-shot kernel's sum against NCCL's on the same inputs (each rank's own random
    [rows, hidden]): the largest absolute difference on this rank; NaN when no one-shot kernel
    is installed."""

    rows: int
    hidden: int
    dtype: torch.dtype

    def run(self, device: torch.device) -> float:
        if not small_all_reduce_installed():
            return float("nan")
        gen = torch.Generator(device="cpu").manual_seed(1234 + tp_rank())
        x = torch.randn(self.rows, self.hidden, generator=gen).to(device, self.dtype)
        ours = all_reduce(x.clone())
        nccl = all_reduce(x.clone(), small_kernel=False)
        return (ours.float() - nccl.float()).abs().max().item()


@dataclass(frozen=True)
class ReduceNormAgreement(WorkerTask):
    """The fused all-reduce + residual add + RMSNorm kernel against NCCL's all-reduce then
    the reference norm, on each rank's own random [rows, hidden]: the largest absolute
    difference of the new residual and of the normed rows on this rank, as (residual, normed);
    (NaN, NaN) when the fused kernel is not installed."""

    rows: int
    hidden: int
    dtype: torch.dtype

    def run(self, device: torch.device) -> tuple[float, float]:
        if not fused_norm_installed():
            return float("nan"), float("nan")
        gen = torch.Generator(device="cpu").manual_seed(4321 + tp_rank())
        x, res = (torch.randn(self.rows, self.hidden, generator=gen) for _ in range(2))
        weight = torch.randn(self.hidden, generator=gen).to(device, self.dtype)
        x, res = x.to(device, self.dtype), res.to(device, self.dtype)
        y, r = all_reduce_rms_norm(x.clone(), res.clone(), weight, 1e-6, False, rms_norm)
        y_want, r_want = rms_norm(
            all_reduce(x.clone(), small_kernel=False), weight, 1e-6, False, residual=res.clone()
        )
        return (
            (r.float() - r_want.float()).abs().max().item(),
            (y.float() - y_want.float()).abs().max().item(),
        )


@dataclass(frozen=True)
class ControlMessage(WorkerTask):
    message: Any  # what rank 0 sends each time (a StepInput)
    repeats: int = 20
    warmup: int = 3

    def run(self, device: torch.device) -> float:
        """Median seconds of one broadcast_object of `message` (rank 0's side)."""
        times = []
        for i in range(self.warmup + self.repeats):
            start = time.perf_counter()
            broadcast_object(self.message)
            if i >= self.warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)


def run_on_all_ranks(task: WorkerTask, device: torch.device) -> float:
    """Rank 0: have every rank run `task` (the engine must be idle: no step in flight) and
    return rank 0's result. Without TP it runs here alone."""
    if tp_size() > 1:
        broadcast_object(task)
    return task.run(device)


def count_all_reduces(fn) -> int:
    """How many all-reduces (parallel_state.all_reduce calls) `fn()` makes."""
    from deltaserve.distributed import parallel_state

    before = parallel_state.ALL_REDUCE_CALLS[0]
    fn()
    return parallel_state.ALL_REDUCE_CALLS[0] - before
