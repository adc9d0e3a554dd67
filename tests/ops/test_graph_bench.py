"""The autotuner's graph timing (deltaserve.ops.graph_bench): its arithmetic and its wiring on
CPU; on a GPU, that it measures what a kernel costs with L2 cold, inside the autotuner too."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from deltaserve.ops import graph_bench as gb
from deltaserve.ops.autotune import autotune


def test_quantile_interpolates_between_ranks_as_torch():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    for q in (0.0, 0.2, 0.5, 0.8, 1.0):
        want = torch.quantile(torch.tensor(values, dtype=torch.float64), q).item()
        assert gb.quantile(values, q) == pytest.approx(want)


def test_per_launch_time_subtracts_the_median_flush_graph():
    # 16 pairs: graphs of 2.0 ms with the kernel, flushes alone 1.0 / 1.2 / 1.1 ms (median 1.1)
    times = gb.per_launch_ms([2.0, 1.9, 1.05], [1.0, 1.2, 1.1], 16)
    assert times == pytest.approx([0.9 / 16, 0.8 / 16, 0.0])  # never below 0


def _tuned():
    @autotune(configs=[triton.Config({"B": 16}), triton.Config({"B": 32})], key=["n"])
    @triton.jit
    def kernel(x_ptr, n, B: tl.constexpr):
        pass

    return kernel


def test_graph_timing_is_the_default_and_events_restore_tritons(monkeypatch):
    monkeypatch.delenv("DELTASERVE_AUTOTUNE_BENCH", raising=False)
    assert _tuned()._do_bench is gb.graph_bench
    monkeypatch.setenv("DELTASERVE_AUTOTUNE_BENCH", "events")
    assert _tuned()._do_bench is None  # Triton's own benchmarker
    monkeypatch.setenv("DELTASERVE_AUTOTUNE_BENCH", "cupti")
    with pytest.raises(ValueError, match="DELTASERVE_AUTOTUNE_BENCH"):
        _tuned()


def test_graph_timed_results_are_filed_apart_in_the_disk_cache(monkeypatch):
    """Under graph timing the disk cache's key carries the method (an event-timed result from
    an earlier start-up is not reused), and a cached choice lands under the launch's own key."""
    monkeypatch.delenv("DELTASERVE_AUTOTUNE_BENCH", raising=False)
    seen = []

    def lookup(self, tuning_key, configs, bench_fn):
        seen.append(tuning_key)
        self.cache[tuning_key] = configs[1]  # as Triton files a result found on disk
        return True

    monkeypatch.setattr(Autotuner, "check_disk_cache", lookup)
    kernel = _tuned()
    assert kernel.check_disk_cache((128, "torch.float32"), kernel.configs, None) is True
    assert seen == [(128, "torch.float32", "graph_bench")]
    assert kernel.cache == {(128, "torch.float32"): kernel.configs[1]}

    monkeypatch.setenv("DELTASERVE_AUTOTUNE_BENCH", "events")
    seen.clear()
    events = _tuned()
    events.check_disk_cache((128, "torch.float32"), events.configs, None)
    assert seen == [(128, "torch.float32")]


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graph_bench_times_a_copy_at_the_memory_rate():
    """A device-to-device copy of 256 MiB runs at 1-6 TB/s of bytes read plus written (an H100
    or H200 copies at 3-4.3: one H200 timed it at 0.127 ms, 4.2 TB/s), and twice the bytes take
    more than 1.5x the time (that H200: 0.397 ms, 3.1x; the larger copy runs below the rate)."""
    n = 64 << 20  # int32 elements: 256 MiB
    src = torch.empty(2 * n, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    one = gb.graph_bench(lambda: dst[:n].copy_(src[:n]))
    two = gb.graph_bench(lambda: dst.copy_(src))
    rate = 2 * n * 4 / (one * 1e-3)
    assert 1e12 < rate < 6e12, rate
    assert two / one > 1.5, (one, two)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tuning_by_graph_keeps_restore_value_and_the_result(monkeypatch):
    """A kernel that updates its output in place (restore_value) is tuned by graph replays and
    its one real launch still adds once: the replays' updates are undone."""
    monkeypatch.setenv("DELTASERVE_AUTOTUNE_CACHE", "0")
    monkeypatch.delenv("DELTASERVE_AUTOTUNE_BENCH", raising=False)

    @autotune(
        configs=[triton.Config({"B": 256}, num_warps=4), triton.Config({"B": 1024}, num_warps=4)],
        key=["n"],
        restore_value=["y_ptr"],
    )
    @triton.jit
    def accumulate(x_ptr, y_ptr, n, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        m = offs < n
        y = tl.load(y_ptr + offs, mask=m) + tl.load(x_ptr + offs, mask=m)
        tl.store(y_ptr + offs, y, mask=m)

    assert accumulate.do_bench is gb.graph_bench
    n = 1 << 20
    x = torch.ones(n, device="cuda")
    y = torch.full((n,), 2.0, device="cuda")
    accumulate[lambda meta: (triton.cdiv(n, meta["B"]),)](x, y, n)
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 3.0))
    assert len(accumulate.configs_timings) == 2
    assert all(0 < t[0] < 1.0 for t in accumulate.configs_timings.values())
