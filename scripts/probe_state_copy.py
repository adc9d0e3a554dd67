"""Prefix-cache state copies at Qwen3.5-9B shapes (GPU machine): the Triton row copy
(ops/fused/copy_rows.py) against the torch reference (index_select + index_copy_ per tensor).

python scripts/probe_state_copy.py

24 GDN layers, conv pools [rows, 8192, 3] bf16 and SSM pools [rows, 32, 128, 128] fp32 (48 MiB a
sequence); for 1, 4 and 16 sequences copied at once: device time (CUDA events, mean of 20) and
the rate in GB/s of bytes read + written, against a plain device-to-device copy of the same bytes.
"""

from __future__ import annotations

import torch

from deltaserve.ops.fused import reference
from deltaserve.ops.fused.copy_rows import copy_rows


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3  # seconds


def main() -> None:
    rows = 40
    tensors = []
    for _ in range(24):
        tensors.append(torch.zeros(rows, 8192, 3, device="cuda", dtype=torch.bfloat16))
        tensors.append(torch.zeros(rows, 32, 128, 128, device="cuda"))
    per_seq = sum(t[0].numel() * t.element_size() for t in tensors)
    flat = torch.empty(16 * per_seq, dtype=torch.uint8, device="cuda")
    flat_out = torch.empty_like(flat)
    print("| sequences | MiB | triton ms | GB/s | reference ms | GB/s | memcpy GB/s |")
    print("|---|---|---|---|---|---|---|")
    for n in (1, 4, 16):
        src = torch.arange(20, 20 + n, device="cuda")
        dst = torch.arange(0, n, device="cuda")
        moved = 2 * n * per_seq
        a, b = flat[: n * per_seq], flat_out[: n * per_seq]
        t_tri = timed(lambda s=src, d=dst: copy_rows(tensors, s, d))
        t_ref = timed(lambda s=src, d=dst: reference.copy_rows(tensors, s, d))
        t_cp = timed(lambda a=a, b=b: b.copy_(a))
        print(
            f"| {n} | {n * per_seq / 2**20:.0f} | {1e3 * t_tri:.3f} | {moved / t_tri / 1e9:.0f} "
            f"| {1e3 * t_ref:.3f} | {moved / t_ref / 1e9:.0f} | {moved / t_cp / 1e9:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
