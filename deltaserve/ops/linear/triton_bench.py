"""Timing of the decode GEMM (GPU only): ours (Triton) against F.linear (cuBLAS) on one shape.

Several copies of the weight are cycled (at least 256 MB in all) so that no call finds its
matrix in the 50 MB L2; the calls over all copies are captured in one CUDA graph and replayed,
as the engine replays decode steps. Bytes counted: the weight, x and the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bench_decode_gemm(rows: int, n: int, k: int, impl: str, dtype=torch.bfloat16) -> dict:
    """{"us", "bytes"} per call of `impl` ("triton" or "cublas") on x [rows, k] @ W [n, k].T."""
    import triton.testing

    from deltaserve.ops.linear.triton_gemm import decode_gemm

    gen = torch.Generator(device="cuda").manual_seed(0)
    elem = torch.finfo(dtype).bits // 8
    copies = max(2, -(-(256 << 20) // (n * k * elem)))
    weights = [
        (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(dtype) for _ in range(copies)
    ]
    x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
    fn = decode_gemm if impl == "triton" else (lambda a, w: F.linear(a, w))

    def run_all() -> None:
        for w in weights:
            fn(x, w)

    run_all()  # compile / autotune outside the graph
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(run_all, rep=100)
    total = (n * k + rows * k + rows * n) * elem
    result = {"us": ms * 1e3 / copies, "bytes": float(total)}
    if impl == "triton":
        from deltaserve.ops.linear.triton_gemm import _decode_gemm_kernel

        result["config"] = str(getattr(_decode_gemm_kernel, "best_config", ""))
    return result
