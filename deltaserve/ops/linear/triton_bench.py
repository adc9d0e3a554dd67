"""Timing of the decode GEMM (GPU only): ours (Triton: the split-K kernel with its chosen or a
given configuration, and the base kernel) against F.linear (cuBLAS) on one shape; and, for a
GEMM that follows a decoder layer's residual add + RMSNorm, that norm fused into the GEMM
(triton_norm_gemm.py, not wired into the engine yet) against the two kernels the engine runs.

Several copies of the weight are cycled (at least 256 MB in all) so that no call finds its
matrix in the 50 MB L2; the calls over all copies are captured in one CUDA graph and replayed,
as the engine replays decode steps. Bytes counted: the weight, x and the output (with the norm:
also the residual read and written and the norm's weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLS = ("triton", "triton-base", "triton-splitk", "cublas")
ONE_ROW_IMPLS = ("triton-gemv",)  # one row only: the GEMV kernel (triton_gemv.py), autotuned
# the residual add + RMSNorm before the GEMM (zero-centred, as Qwen3.5's), up to 16 rows: fused
# into it, or the engine's two kernels (rms_norm with the residual, then its decode GEMM)
NORM_IMPLS = ("triton-norm", "norm+triton")
# one row: the norm in the GEMV's launch (triton_gemv_norm.py, the engine's choice at hidden
# sizes up to triton_gemm.NORM_GEMV_MAX_K), against "norm+triton" (there: rms_norm, the GEMV)
ONE_ROW_NORM_IMPLS = ("triton-gemv-norm",)
NORM_EPS = 1e-6


def bench_decode_gemm(
    rows: int, n: int, k: int, impl: str, dtype=torch.bfloat16, configs: list | None = None
) -> dict:
    """{"us", "bytes", "config"} per call of `impl` on x [rows, k] @ W [n, k].T: "triton" (what
    the engine runs: the TritonDecodeGemm backend with DELTASERVE_DECODE_GEMM_KERNEL's choice,
    auto by default, cuBLAS included where it chooses it by shape above 16 rows),
    "triton-base" (the base kernel, autotuned), "triton-splitk" (the split-K kernel where its
    configuration for the shape splits K or above 16 rows, else the base kernel:
    `decode_gemm`'s "splitk"), "cublas" or (one row) "triton-gemv" (the GEMV kernel,
    autotuned); with the residual
    add + RMSNorm over x first (rows <= 16), "triton-norm" (fused, one kernel),
    "triton-gemv-norm" (one row: the norm in the GEMV's launch) or "norm+triton" (rms_norm,
    then what "triton" runs). With `configs` (split-K
    configurations for impl "triton", the base kernel's `triton.Config`s for "triton-base"),
    each is timed and the fastest reported (its "config"), with every timing under "sweep"."""
    import triton.testing

    from deltaserve.ops.linear.triton_gemm import (
        TritonDecodeGemm,
        _decode_gemm_kernel,
        decode_gemm,
        decode_gemm_base,
    )
    from deltaserve.ops.linear.triton_splitk import decode_gemm_splitk

    known = IMPLS + NORM_IMPLS + ONE_ROW_IMPLS + ONE_ROW_NORM_IMPLS
    if impl not in known:
        raise ValueError(f"impl must be one of {known}, got {impl!r}")
    if impl in ONE_ROW_IMPLS + ONE_ROW_NORM_IMPLS and rows != 1:
        raise ValueError(f"{impl} serves one row, got {rows}")
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

    if impl in NORM_IMPLS + ONE_ROW_NORM_IMPLS:
        return _time_with_norm(impl, x, weights[0], time_fn, total)
    if impl == "cublas":
        return {"us": time_fn(lambda a, w: F.linear(a, w)), "bytes": float(total)}
    if impl == "triton-gemv":
        from deltaserve.ops.linear.triton_gemv import _decode_gemv_kernel, decode_gemv

        us = time_fn(decode_gemv)
        return {"us": us, "bytes": float(total), "config": str(_decode_gemv_kernel.best_config)}
    if impl == "triton-base" and not configs:
        us = time_fn(decode_gemm_base)
        return {"us": us, "bytes": float(total), "config": str(_decode_gemm_kernel.best_config)}
    if impl == "triton" and not configs:  # the engine's backend object, choices included
        gemm = TritonDecodeGemm()
        us = time_fn(gemm)
        return {"us": us, "bytes": float(total), "config": _runs(x, weights[0], gemm)}
    if not configs:  # "triton-splitk": decode_gemm's "splitk"
        us = time_fn(lambda a, w: decode_gemm(a, w, None, "splitk"))
        return {"us": us, "bytes": float(total), "config": _runs(x, weights[0], "splitk")}
    from triton.runtime.errors import OutOfResources

    sweep = []
    for cfg in configs:
        if impl == "triton-base":
            fn, label = (lambda a, w, c=cfg: decode_gemm_base(a, w, None, c)), str(cfg)
        else:
            fn, label = (lambda a, w, c=cfg: decode_gemm_splitk(a, w, None, c)), cfg.describe()
        try:
            us = time_fn(fn)
        except OutOfResources:  # smem_estimate is a model: a tile it let through did not fit
            continue
        sweep.append((us, label))
    best = min(sweep)
    return {"us": best[0], "bytes": float(total), "config": best[1], "sweep": sweep}


def _time_with_norm(
    impl: str, x: torch.Tensor, weight: torch.Tensor, time_fn, gemm_bytes: int
) -> dict:
    """`bench_decode_gemm` for the NORM_IMPLS (x [rows, k], one of the weights cycled): each
    call first adds x into a residual [rows, k] (in place; the residual grows over the replays,
    which the norm's output does not see) and normalises the sum, fused or as the engine's
    separate kernel."""
    from deltaserve.ops.fused.rmsnorm import rms_norm
    from deltaserve.ops.linear.triton_gemm import TritonDecodeGemm
    from deltaserve.ops.linear.triton_norm_gemm import (
        _add_rms_norm_gemm_kernel,
        add_rms_norm_gemm,
    )

    rows, k = x.shape
    if rows > 16:
        raise ValueError(f"{impl} serves at most 16 rows, got {rows}")
    gen = torch.Generator(device="cuda").manual_seed(1)
    residual = torch.randn(rows, k, device="cuda", generator=gen).to(x.dtype)
    norm_w = (torch.randn(k, device="cuda", generator=gen) * 0.1).to(x.dtype)
    total = gemm_bytes + 2 * residual.nbytes + norm_w.nbytes
    if impl == "triton-norm":

        def fused(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return add_rms_norm_gemm(a, residual, norm_w, NORM_EPS, w, None, True)

        us = time_fn(fused)
        config = str(_add_rms_norm_gemm_kernel.best_config)
        return {"us": us, "bytes": float(total), "config": config}
    if impl == "triton-gemv-norm":  # one row; the new stream into a buffer of its own
        from deltaserve.ops.linear.triton_gemv_norm import (
            _decode_gemv_norm_kernel,
            decode_gemv_add_norm,
        )

        stream = torch.empty_like(residual)

        def gemv_norm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return decode_gemv_add_norm(a, residual, norm_w, NORM_EPS, True, w, residual_out=stream)

        us = time_fn(gemv_norm)
        config = str(getattr(_decode_gemv_norm_kernel, "best_config", None))
        return {"us": us, "bytes": float(total), "config": config}
    gemm = TritonDecodeGemm()  # the engine's (DELTASERVE_DECODE_GEMM_KERNEL)

    def two_kernels(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h, _ = rms_norm(a, norm_w, NORM_EPS, True, residual=residual)
        return gemm(h, w)

    us = time_fn(two_kernels)
    return {"us": us, "bytes": float(total), "config": "rms_norm + " + _runs(x, weight, gemm)}


def _runs(x: torch.Tensor, weight: torch.Tensor, kernel) -> str:  # noqa: ANN001
    """What `decode_gemm(x, weight, kernel=kernel)` ran, or the backend object `kernel` (a
    TritonDecodeGemm): "cuBLAS" (the backend's choice by shape above 16 rows), "split-K: <its
    configuration>" or "base: <the tuner's choice>" (after a call)."""
    from deltaserve.ops.linear.triton_gemm import _decode_gemm_kernel, splitk_config

    if not isinstance(kernel, str):
        if kernel.uses_cublas(x, weight):
            return "cuBLAS"
        kernel = kernel.kernel
    if kernel == "auto" and x.shape[0] == 1:
        from deltaserve.ops.linear.triton_gemv import _decode_gemv_kernel

        return f"gemv: {getattr(_decode_gemv_kernel, 'best_config', None)}"

    cfg = splitk_config(x, weight, kernel)
    if cfg is not None:
        return f"split-K: {cfg.describe()}"
    return f"base: {getattr(_decode_gemm_kernel, 'best_config', None)}"
