"""The split-K decode GEMM's wide tiles (17..64 rows) against cuBLAS on the 9B decode shapes
(GPU only): per shape and row count, the chosen configuration and F.linear, then (with
--sweep) every swept configuration at 64 rows on the first two shapes. Prints a markdown table
and writes JSON (--json).

python scripts/probe_wide_gemm.py [--rows 32,64] [--sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    from deltaserve.bench.floors import measure_ceilings
    from deltaserve.bench.kernels import GEMM_SHAPES_9B
    from deltaserve.ops.linear.triton_bench import bench_decode_gemm
    from deltaserve.ops.linear.triton_splitk import sweep_configs

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32,64")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = measure_ceilings(torch.device("cuda")).copy_bytes_per_s
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s")
    print("| rows | N x K | impl | us | % of copy | config |")
    print("| ---: | --- | --- | ---: | ---: | --- |")
    out = []
    for m in [int(r) for r in args.rows.split(",")]:
        for i, (n, k) in enumerate(GEMM_SHAPES_9B):
            runs = [("triton", None), ("cublas", None)]
            if args.sweep and m == 64 and i < 2:
                runs.append(("triton", sweep_configs(m, n, k)))
            for impl, configs in runs:
                res = bench_decode_gemm(m, n, k, impl, configs=configs)
                pct = 100 * res["bytes"] / (res["us"] * 1e-6) / bw
                name = impl + (" best" if configs else "")
                print(
                    f"| {m} | {n} x {k} | {name} | {res['us']:.1f} | {pct:.1f}% | "
                    f"{res.get('config', '')} |",
                    flush=True,
                )
                out.append(dict(rows=m, n=n, k=k, impl=name, pct_of_copy=pct, **res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw": bw, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
