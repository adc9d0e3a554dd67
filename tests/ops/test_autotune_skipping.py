"""The autotuner wrapper: a configuration whose compile raises is benched as +inf, not fatal."""

from __future__ import annotations

import math

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
