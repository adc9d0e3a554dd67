"""Host time of torch's cuBLAS linear per call: shapes seen before vs a new row count per call.

python scripts/probe_linear_host.py   (GPU machine)

A serving step's prefill has a new token count almost every time; if cuBLAS chooses its
algorithm per new shape on the host, every GEMM of such a step pays for it. Prints microseconds
of host time per F.linear call (no sync inside the timed loop; the GPU runs behind) for:
repeated M, a new M per call, and new M rounded up to a bucket (a view of a padded buffer).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def host_us(fn, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / n


def probe(lib: str, base: int, w: torch.Tensor, x: torch.Tensor) -> None:
    """One line of host times for weight w: x [>= 8192, K] contiguous."""
    F.linear(x[:256], w)  # warm
    rep = host_us(lambda i: F.linear(x[:256], w), 200)
    new = host_us(lambda i: F.linear(x[: base + 3 * i + 1], w), 200)
    again = host_us(lambda i: F.linear(x[: base + 3 * i + 1], w), 200)
    bucket = host_us(lambda i: F.linear(x[: ((base + 3 * i + 1 + 63) // 64) * 64], w), 200)
    print(
        f"{lib:9s} W {tuple(w.shape)}: repeated M {rep:6.1f} us | new M {new:6.1f} us | "
        f"same new Ms again {again:6.1f} us | M rounded to 64 {bucket:6.1f} us",
        flush=True,
    )


def main() -> None:
    dev = "cuda"
    shapes = [(12288, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
    xs = {k: torch.randn(8192, k, device=dev, dtype=torch.bfloat16) for k in (4096, 12288)}
    for j, lib in enumerate(("default", "cublaslt", "cublas")):
        if lib != "default":
            torch.backends.cuda.preferred_blas_library(lib)
        for n, k in shapes:
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            probe(lib, 100 + 1000 * j, w, xs[k])


if __name__ == "__main__":
    main()
