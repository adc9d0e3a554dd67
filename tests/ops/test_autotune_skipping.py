"""The autotuner wrapper: a configuration whose compile raises is benched as +inf, not fatal."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from deltaserve.ops.autotune import autotune


@autotune(
    configs=[triton.Config({"B": 16}, num_warps=2), triton.Config({"B": 32}, num_warps=4)],
    key=["n"],
)
@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def test_compiler_error_benches_as_inf(monkeypatch):
    broken = _copy_kernel.configs[0]

    def bench(self, *args, config, **meta):
        if config is broken:
            raise RuntimeError("PassManager::run failed")
        return [1.0, 1.0, 1.0]

    monkeypatch.setattr(Autotuner, "_bench", bench)
    assert _copy_kernel._bench(config=broken) == [math.inf] * 3
    assert _copy_kernel._bench(config=_copy_kernel.configs[1]) == [1.0, 1.0, 1.0]


def test_other_errors_still_raise(monkeypatch):
    def bench(self, *args, config, **meta):
        raise ValueError("not a compiler error")

    monkeypatch.setattr(Autotuner, "_bench", bench)
    with pytest.raises(ValueError):
        _copy_kernel._bench(config=_copy_kernel.configs[0])


def test_results_are_cached_on_disk_unless_turned_off(monkeypatch):
    """Tuned kernels ask Triton to keep their choice in its on-disk cache (a later start-up
    compiles only the chosen configuration; Triton itself turns the cache off under its
    interpreter); DELTASERVE_AUTOTUNE_CACHE=0 measures afresh."""
    import deltaserve.ops.autotune as wrapper

    asked = []
    real_init = Autotuner.__init__

    def init(self, *args, cache_results=False, **kwargs):
        asked.append(cache_results)
        real_init(self, *args, cache_results=cache_results, **kwargs)

    monkeypatch.setattr(wrapper._SkippingAutotuner, "__init__", init)

    def tuned():
        @autotune(configs=[triton.Config({"B": 16}), triton.Config({"B": 32})], key=["n"])
        @triton.jit
        def kernel(x_ptr, n, B: tl.constexpr):
            pass

        return kernel

    assert isinstance(tuned(), Autotuner)
    monkeypatch.setenv("DELTASERVE_AUTOTUNE_CACHE", "0")
    tuned()
    assert asked == [True, False]


def test_every_autotuned_kernel_goes_through_the_wrapper():
    """No kernel uses triton.autotune directly (it would neither skip configurations that fail
    to compile nor cache its choice)."""
    import deltaserve

    root = Path(deltaserve.__file__).parent
    direct = [p for p in root.rglob("*.py") if "@triton.autotune(" in p.read_text()]
    assert direct == []


def test_float32_launches_are_not_tuned():
    """A launch with PRECISION="ieee" (float32 operands) prunes the list to its smallest
    configuration (tiles times warps); any other launch keeps every configuration."""
    big = triton.Config({"BLOCK_N": 64, "BLOCK_K": 256}, num_warps=4)
    small = triton.Config({"BLOCK_N": 16, "BLOCK_K": 128}, num_warps=4)
    wide_warps = triton.Config({"BLOCK_N": 16, "BLOCK_K": 128}, num_warps=8)
    configs = [big, wide_warps, small]
    assert _copy_kernel.early_config_prune(configs, {}, PRECISION="ieee") == [small]
    assert _copy_kernel.early_config_prune(configs, {}, PRECISION="tf32") == configs
    assert _copy_kernel.early_config_prune(configs, {}) == configs


def test_a_kernels_own_prune_runs_before_the_float32_one_and_restore_value_is_passed():
    """`autotune(prune=...)` narrows the list first (by the launch's keyword arguments), then
    the float32 rule applies to what is left; `restore_value` reaches Triton's autotuner."""
    four = [triton.Config({"B": b}, num_warps=4) for b in (64, 16)]
    eight = triton.Config({"B": 16}, num_warps=8)

    @autotune(
        configs=[*four, eight],
        key=["n"],
        prune=lambda configs, named_args, **kw: [c for c in configs if c.num_warps == kw["W"]],
        restore_value=["y_ptr"],
    )
    @triton.jit
    def kernel(x_ptr, y_ptr, n, W: tl.constexpr, B: tl.constexpr):
        pass

    assert kernel.early_config_prune(kernel.configs, {}, W=4) == four
    assert kernel.early_config_prune(kernel.configs, {}, W=4, PRECISION="ieee") == [four[1]]
    assert kernel.restore_value == ["y_ptr"]
