"""Triton autotuning that skips a configuration the compiler cannot lower.

Triton's autotuner skips configurations that run out of resources or fail a compile-time
assertion, but an MLIR pass failure (a RuntimeError from the compiler) escapes it and kills the
process. One such failure hit the MoE decode kernels on H100s at the tensor-parallel shard
shapes (intermediate 256 per rank) with a 2-warp 16 x 16 tile. `autotune` below benches such a
configuration as infinitely slow, logs it once, and lets the tuner pick among the rest; when no
configuration compiles, the launch itself raises.

Every kernel tuned through `autotune` keeps its results in Triton's on-disk cache
(`cache_results`: keyed by the Triton version, the GPU target, the kernel's source, the tuning
key and the configuration list), so a later start-up on the same machine skips the benchmark and
compiles only the chosen configuration: the MoE decode kernels alone measured 12-18
configurations per key and batch bucket on every start. DELTASERVE_AUTOTUNE_CACHE=0 measures
afresh each time.

A launch with float32 operands (`PRECISION="ieee"`: the parity tests' float32 models, never a
served 16-bit one) is not tuned: it runs the configuration with the smallest tiles, which also
fits float32's doubled register and shared-memory footprint. Tuning it measured every
configuration at every decode batch bucket: minutes of compilation per test on a fresh GPU.

Each configuration is timed by `graph_bench.graph_bench` (launches replayed from a CUDA graph,
L2 flushed before each: how a decode step runs them) instead of Triton's per-launch event
timing, which measured the host's launch latency as much as the decode kernels;
DELTASERVE_AUTOTUNE_BENCH=events restores Triton's. The two keep their results apart in the
disk cache.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from triton.runtime.autotuner import Autotuner

from deltaserve import env
from deltaserve.ops.graph_bench import graph_bench

logger = logging.getLogger(__name__)


class _SkippingAutotuner(Autotuner):
    """An Autotuner whose benchmark of one configuration treats a compiler error as +inf."""

    def _bench(self, *args, config, **meta):  # noqa: ANN001, ANN202 (Triton's signature)
        try:
            return super()._bench(*args, config=config, **meta)
        except RuntimeError as e:
            logger.warning(
                "%s: configuration %s does not compile here, skipped (%s)",
                getattr(self.fn, "__name__", self.fn),
                config,
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
            return [math.inf, math.inf, math.inf]

    def check_disk_cache(self, tuning_key, configs, bench_fn):  # noqa: ANN001, ANN201
        """Triton's disk cache, with the timing method in the key under graph timing (results
        measured by Triton's event timing, the default before, are not reused for it)."""
        if self._do_bench is not graph_bench or not tuning_key:
            return super().check_disk_cache(tuning_key, configs, bench_fn)
        salted = (*tuning_key, "graph_bench")
        found = super().check_disk_cache(salted, configs, bench_fn)
        if salted in self.cache:  # a cached result is filed under the salted key: move it
            self.cache[tuning_key] = self.cache.pop(salted)
        return found


def _tile_size(config) -> int:  # noqa: ANN001 (a triton.Config)
    """The product of a configuration's integer meta-parameters (its tile sizes) and warps."""
    return math.prod(v for v in config.kwargs.values() if isinstance(v, int)) * config.num_warps


def _float32_untuned(configs: list, named_args: dict, **kwargs) -> list:  # noqa: ANN001
    """Triton's early pruning hook: only the smallest configuration for float32 operands."""
    if kwargs.get("PRECISION") == "ieee":
        return [min(configs, key=_tile_size)]
    return configs


def autotune(
    configs: list,
    key: list[str],
    prune: Callable[..., list] | None = None,
    restore_value: list[str] | None = None,
):
    """`triton.autotune(configs, key)` that skips configurations failing to compile, caches its
    choice on disk and does not tune float32 launches (see the module docstring). `prune`:
    an extra early pruning hook, (configs, named_args, **launch kwargs) -> configs, applied
    first; `restore_value`: arguments the kernel writes in place, restored after each timed
    run (Triton's own option)."""

    def early_prune(configs: list, named_args: dict, **kwargs) -> list:  # noqa: ANN001
        if prune is not None:
            configs = prune(configs, named_args, **kwargs)
        return _float32_untuned(configs, named_args, **kwargs)

    def decorator(fn):  # noqa: ANN001, ANN202
        return _SkippingAutotuner(
            fn,
            fn.arg_names,
            configs,
            key,
            None,
            restore_value,
            prune_configs_by={"early_config_prune": early_prune},
            do_bench=graph_bench if env.autotune_bench() == "graph" else None,
            cache_results=env.autotune_cache(),
        )

    return decorator
