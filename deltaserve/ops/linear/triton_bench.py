"""Timing of the decode GEMM (GPU only): ours (Triton: the split-K kernel with its chosen or a
given configuration, and the base kernel) against F.linear (cuBLAS) on one shape.

Several copies of the weight are cycled (at least 256 MB in all) so that no call finds its
matrix in the 50 MB L2; the calls over all copies are captured in one CUDA graph and replayed,
as the engine replays decode steps. Bytes counted: the weight, x and the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLS = ("triton", "triton-base", "cublas")


def bench_decode_gemm(
    rows: int, n: int, k: int, impl: str, dtype=torch.bfloat16, configs: list | None = None
) -> dict:
    """{"us", "bytes", "config"} per call of `impl` on x [rows, k] @ W [n, k].T: "triton" (what
    the engine runs: the split-K kernel where its configuration for the shape splits K, else
    the base kernel), "triton-base" (the base kernel, autotuned) or "cublas". With `configs`
    (split-K configurations, impl "triton"), each is timed and the fastest reported (its
    "config"), with every timing under "sweep"."""
    import triton.testing

    from deltaserve.ops.linear.triton_gemm import _decode_gemm_kernel, decode_gemm_base
    from deltaserve.ops.linear.triton_splitk import (
        choose_config,
        decode_gemm_splitk,
        num_sms,
        runs_splitk,
    )

    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    elem = torch.finfo(dtype).bits // 8
    copies = max(2, -(-(256 << 20) // (n * k * elem)))
    weights = [
        (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(dtype) for _ in range(copies)
    ]
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    total = (n * k + rows * k + rows * n) * elem

    def time_fn(fn) -> float:
        def run_all() -> None:
            for w in weights:
                fn(x, w)

        run_all()  # compile / autotune outside the graph
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(run_all, rep=100) * 1e3 / copies

    if impl == "cublas":
        return {"us": time_fn(lambda a, w: F.linear(a, w)), "bytes": float(total)}
    if impl == "triton-base":
        us = time_fn(decode_gemm_base)
        return {"us": us, "bytes": float(total), "config": str(_decode_gemm_kernel.best_config)}
    if not configs:
        cfg = choose_config(rows, n, k, num_sms(x.device))
        if not runs_splitk(cfg, rows):  # the engine runs the base kernel here
            us = time_fn(decode_gemm_base)
            config = f"base: {_decode_gemm_kernel.best_config}"
            return {"us": us, "bytes": float(total), "config": config}
        us = time_fn(lambda a, w: decode_gemm_splitk(a, w, None, cfg))
        return {"us": us, "bytes": float(total), "config": cfg.describe()}
    from triton.runtime.errors import OutOfResources

    sweep = []
    for cfg in configs:
        try:
            us = time_fn(lambda a, w, c=cfg: decode_gemm_splitk(a, w, None, c))
        except OutOfResources:  # smem_estimate is a model: a tile it let through did not fit
            continue
        sweep.append((us, cfg.describe()))
    best = min(sweep)
    return {"us": best[0], "bytes": float(total), "config": best[1], "sweep": sweep}
