"""The autotuner's timing of one kernel configuration as a decode step runs it: launches replayed
from a CUDA graph, each after an L2 flush.

Why: Triton's own timing (`triton.testing.do_bench`) records a pair of events around every
launch, after a memset that flushes L2, with the host launching each one. For the 5-25 us
decode kernels that measures the host as much as the kernel: on one H200 the MoE down kernel's
configurations were timed at 22.8-80 us (the 20th to 80th percentile of one of them) where the
profiler puts the chosen one at 11 us in the decode graph, and on the 35B-A3B's 2048 x 4096
projection the tuner chose the slowest of its 15 configurations (11.9 us in a graph against
7.7 us for the fastest; docs/benchmarks.md). A decode step replays all its kernels from one
graph, so no host work sits between them, and each layer's weights are read once per step, so
they are never in L2.

Here `PAIRS` (flush, launch) pairs are captured into one graph and the graph is replayed
`REPLAYS` times, alternating with a graph of the flushes alone; a launch's time is the
difference per pair. The flush writes twice the L2's size. Kernels the engine launches with
programmatic dependent launch (ops/pdl.py) start their weight loads during the flush's last
blocks, as they start them during the previous kernel's in a step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

PAIRS = 16  # (flush, launch) pairs per graph
REPLAYS = 7  # timed replays of each graph, alternating


@functools.cache
def _flush_elements(device_index: int) -> int:
    """int32 elements of the flush scratch: twice the device's L2 size, at least 32 MiB."""
    l2 = torch.cuda.get_device_properties(device_index).L2_cache_size
    return max(2 * l2, 32 << 20) // 4


def _capture(body: Callable[[], None], pairs: int) -> torch.cuda.CUDAGraph:
    """A graph of `pairs` calls of `body`, captured on a side stream (no garbage collection or
    allocator flush per capture, unlike torch.cuda.graph: a tuning run captures hundreds)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(pairs):
                body()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (linear between the two nearest ranks, as torch.quantile)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def per_launch_ms(with_kernel: list[float], flushes: list[float], pairs: int) -> list[float]:
    """Each replay's time per launch: (graph of pairs - median graph of flushes) / pairs, at
    least 0 (replay times in ms)."""
    base = quantile(flushes, 0.5)
    return [max(t - base, 0.0) / pairs for t in with_kernel]


def graph_bench(
    kernel_call: Callable[[], None], quantiles: tuple[float, ...] | None = None, **_: object
) -> float | list[float]:
    """Triton's `do_bench` interface for the autotuner: the time of one `kernel_call` in ms
    (its median, or the given quantiles of the per-replay times). The first call runs eagerly
    (it compiles: a configuration that fails to compile raises here, outside any capture)."""
    device = torch.cuda.current_device()
    # per call, not kept: ~100 MB held for the process would come out of the cache's memory
    flush = torch.empty(_flush_elements(device), dtype=torch.int32, device=device)
    kernel_call()
    torch.cuda.synchronize()

    def pair() -> None:
        flush.zero_()
        kernel_call()

    with_kernel = _capture(pair, PAIRS)
    flush_only = _capture(flush.zero_, PAIRS)
    _replay_ms(with_kernel), _replay_ms(flush_only)  # warm: the first replay uploads the graph
    timed_kernel, timed_flush = [], []
    for _ in range(REPLAYS):
        timed_flush.append(_replay_ms(flush_only))
        timed_kernel.append(_replay_ms(with_kernel))
    times = per_launch_ms(timed_kernel, timed_flush, PAIRS)
    if quantiles is None:
        return quantile(times, 0.5)
    return [quantile(times, q) for q in quantiles]
