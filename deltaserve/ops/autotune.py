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
"""

from __future__ import annotations

import logging
import math

from triton.runtime.autotuner import Autotuner

from deltaserve import env

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


def autotune(configs: list, key: list[str]):
    """`triton.autotune(configs, key)` that skips configurations failing to compile and caches
    its choice on disk (see the module docstring)."""

    def decorator(fn):  # noqa: ANN001, ANN202
        return _SkippingAutotuner(
            fn, fn.arg_names, configs, key, None, None, cache_results=env.autotune_cache()
        )

    return decorator
