"""`deltaserve bench kernels`: decode kernel microbenchmarks against the copy-bandwidth floor.

Times one layer's decode kernels on the current CUDA device: the GDN recurrent step (HV=32, HK=16,
K=V=128, float32 and bfloat16 pools; ours in Triton, FlashInfer's CuTe DSL kernels, fla-core's
fused_recurrent and the torch reference for float32) per batch size, and paged decode attention
(ours in Triton, FlashInfer's tensor-core and CUDA-core decode; deltaserve.bench.attention_kernels)
per batch size, context and head shape. Every figure is stated against its floor: bytes moved /
the device's copy rate (measured at start, deltaserve.bench.floors, or given with --copy-bw),
where the bytes are the state read and written plus the activations (GDN), every sequence's K and
V plus q and the output (attention),
W + x + out (decode GEMM on the Qwen3.5-35B-A3B and 9B projections: our split-K kernel, our base
kernel and cuBLAS; with `--gemm-sweep` the best split-K and base configurations too; on the
projections after a norm, that residual add + RMSNorm fused into the GEMM against the two kernels),
or the distinct selected experts' weights + x, router logits and out (MoE routed experts, every
`moe` backend per token count on Qwen3.5-35B-A3B's shapes, with TFLOP/s), absorbed MLA decode
(`--only mla`, deltaserve.bench.mla_kernels: bytes = the latents read).
GDN prefill (`--only gdn_prefill`): one layer's call at chat-turn shapes, device AND host time per
call (fla alone, the `fla` backend with its short-row split, our one-launch Triton kernel and its
tiling variants), from which the split point is chosen.

Prints markdown tables; `--json PATH` writes the rows too. A kernel that is missing or fails
leaves an error row and the rest still runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from deltaserve.bench.throughput import _int_list

GDN_SHAPE = dict(num_v_heads=32, num_k_heads=16, head_dim=128)
GDN_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
GDN_BATCHES_QUICK = [1, 32, 128, 512]
GDN_STATES = ("float32", "bfloat16")  # the pool's dtype (--state-dtype)

# GDN prefill (seqs, new tokens per seq): a chat turn with prefix caching (16 x 171), one such
# row, short rows, one long row (deltaserve.ops.gdn.prefill_bench)
GDN_PREFILL_POINTS = [(16, 171), (1, 171), (16, 16), (1, 1024), (1, 8192)]

# Qwen3.5-9B's decode projections (N, K): GDN in_proj, out_proj / o_proj, MLP gate_up, down,
# attention qkv
GEMM_SHAPES_9B = [(12352, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (10240, 4096)]
# Qwen3.5-35B-A3B's: GDN in_proj, out_proj / o_proj, attention qkv (with its output gate), the
# MoE block's fused in_proj (shared gate/up, router, shared-expert gate), the shared down
GEMM_SHAPES_35B = [(12352, 2048), (2048, 4096), (9216, 2048), (1281, 2048), (2048, 512)]
GEMM_SHAPES = GEMM_SHAPES_35B + GEMM_SHAPES_9B
# the projections right after a decoder layer's residual add + RMSNorm and its only reader (GDN
# in_proj, attention qkv, MLP gate_up; not the MoE block's, whose norm output also feeds the
# experts): rows `triton-norm` (the norm fused into the GEMM) and `norm+triton` (the two kernels)
NORM_GEMM_SHAPES = [(12352, 2048), (9216, 2048), (12352, 4096), (24576, 4096), (10240, 4096)]
GEMM_ROWS = [1, 4, 16, 32, 64]
GEMM_ROWS_QUICK = [1, 16, 64]

# MoE routed experts (Qwen3.5-35B-A3B's shapes, deltaserve.ops.moe.triton_bench): tokens per call
MOE_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MOE_TOKENS_QUICK = [1, 16, 64, 256]


def add_parser(subcommands: Any) -> None:
    """Register `kernels` on the `deltaserve bench` sub-commands."""
    p = subcommands.add_parser(
        "kernels",
        help="GDN decode / prefill and paged decode attention kernels against their floors",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--quick", action="store_true", help="a few sizes only")
    p.add_argument(
        "--only",
        choices=["gdn", "gdn_prefill", "attention", "gemm", "moe", "mla"],
        default=None,
        help="one family",
    )
    p.add_argument(
        "--gemm-sweep",
        nargs="?",
        const="all",
        default=None,
        choices=["all", "splitk", "base"],
        help="decode GEMM: also time every split-K configuration of the sweep on the "
        "Qwen3.5-35B-A3B shapes at 1 row and the 9B shapes at 1 and 64 rows (a `triton-best` row "
        "each), and every configuration of the base kernel's tuner at 1, 16 and 64 rows on all "
        "shapes (a `triton-base-best` row each, against `triton-base`, the tuner's choice); "
        "each row names its configuration, the JSON keeps every timing (minutes); `splitk` or "
        "`base`: one of the two sweeps",
    )
    p.add_argument(
        "--gemm-shapes",
        choices=["all", "9b", "35b"],
        default="all",
        help="gemm: the projections of both models (default) or of one",
    )
    p.add_argument(
        "--gemm-rows",
        type=_int_list,
        default=None,
        metavar="M,M",
        help=f"gemm: the row counts (default {','.join(map(str, GEMM_ROWS))})",
    )
    p.add_argument(
        "--moe-tokens",
        type=_int_list,
        default=None,
        metavar="T,T",
        help=f"moe: the token counts (default {','.join(map(str, MOE_TOKENS))})",
    )
    p.add_argument(
        "--copy-bw",
        type=float,
        default=None,
        metavar="B/S",
        help="copy ceiling (bytes read + written per second); default: measured on the device",
    )
    p.add_argument(
        "--moe-tp",
        type=int,
        default=1,
        metavar="N",
        help="moe: each expert's intermediate as one rank of tensor parallelism N holds it "
        "(512 / N; default 1)",
    )
    p.add_argument(
        "--mla-variants",
        type=_mla_variants,
        default=None,
        metavar="JSON",
        help="mla: the Triton configurations timed beside the default, a JSON list of "
        'decode_config overrides (e.g. \'[{"NUM_SPLITS": 6}, {"BLOCK_N": 32}]\'; '
        "default: the bench's own list)",
    )
    p.add_argument(
        "--mla-heads",
        type=_int_list,
        default=None,
        metavar="H,H",
        help="mla: the query head counts (default 16,128)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(handler=handler)


def _mla_variants(text: str) -> list[dict]:
    """--mla-variants: a JSON list of objects, each a set of decode_config overrides."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--mla-variants is not JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) and v for v in value):
        raise argparse.ArgumentTypeError(
            f"--mla-variants takes a JSON list of non-empty objects, got {text!r}"
        )
    return value


def kernel_row(family: str, impl: str, bytes_: float | None, us: float | None, **shape) -> dict:
    """One result row (its floor comes later, `add_floors`); `us` None marks an error row."""
    row = dict(family=family, impl=impl, **shape, us=us, bytes=bytes_)
    if us and bytes_:
        row["tb_s"] = bytes_ / (us * 1e-6) / 1e12
    return row


def measured_row(
    family: str, impl: str, what: str, fields: dict, errors: list[str], measure: Callable
) -> dict:
    """The row of `measure()` -> (bytes, us, more fields), called now, or an error row when it
    raises (the error also added to `errors`, named by `what`); the device's cached memory is
    freed after each measurement either way."""
    import torch

    try:
        bytes_, us, more = measure()
        row = kernel_row(family, impl, bytes_, us, **fields, **more)
    except Exception as e:  # noqa: BLE001 - report and keep going
        errors.append(f"{what}: {type(e).__name__}: {e}")
        row = kernel_row(family, impl, None, None, **fields, error=str(e)[:200])
    torch.cuda.empty_cache()
    return row


def add_floors(rows: list[dict], copy_bw: float) -> None:
    """Give each row its floor: bytes / `copy_bw` (bytes read + written per second)."""
    for row in rows:
        row["floor_us"] = row["bytes"] / copy_bw * 1e6 if row["bytes"] else None
        if row["us"] and row["floor_us"]:
            row["pct_floor"] = 100.0 * row["floor_us"] / row["us"]


def gdn_impls(state: str, errors: list[str]) -> list[str]:
    """The GDN decode implementations timed for a pool of dtype `state`: ours, FlashInfer's
    (where its CuTe DSL kernels import), and for float32 fla-core's (it keeps a float32 state
    of its own) and the torch reference."""
    from deltaserve.backend_checks import flashinfer_gdn_kernel_reason, package_installed

    impls = ["triton"]
    if not package_installed("flashinfer"):
        errors.append(f"gdn {state}: flashinfer not installed, its rows are skipped")
    elif (reason := flashinfer_gdn_kernel_reason(state)) is not None:
        errors.append(f"gdn {state}: flashinfer rows skipped: {reason}")
    else:
        impls.append("flashinfer")
    if state == "float32":
        impls += ["fla", "torch"]
    return impls


def bench_gdn(batches: list[int], errors: list[str]) -> list[dict]:
    """GDN decode rows via deltaserve.ops.gdn.triton_bench.bench_gdn_decode: every impl, both
    pool dtypes."""
    import torch

    try:
        from deltaserve.ops.gdn.triton_bench import bench_gdn_decode
    except ImportError as e:
        errors.append(f"gdn: deltaserve.ops.gdn.triton_bench.bench_gdn_decode unavailable ({e})")
        return []
    rows = []
    for state in GDN_STATES:
        impls = gdn_impls(state, errors)
        for batch in batches:
            for impl in impls:

                def measure(batch=batch, impl=impl, state=state) -> tuple:
                    dtype = getattr(torch, state)
                    res = bench_gdn_decode(batch, **GDN_SHAPE, state_dtype=dtype, impl=impl)
                    return res["bytes"], res["us"], {}

                shape = dict(batch=batch, **GDN_SHAPE, state=state)
                what = f"gdn {impl} {state} B={batch}"
                rows.append(measured_row("gdn", impl, what, shape, errors, measure))
    return rows


def bench_gdn_prefill_rows(points: list[tuple[int, int]], errors: list[str]) -> list[dict]:
    """GDN prefill rows via deltaserve.ops.gdn.prefill_bench: every impl per (seqs, tokens),
    float32 pool, device and host microseconds per call."""
    from deltaserve.backend_checks import package_installed
    from deltaserve.ops.gdn.prefill_bench import bench_gdn_prefill, prefill_impls

    has_fla = package_installed("fla")
    if not has_fla:
        errors.append("gdn_prefill: fla not installed, its rows (fla, fla-split) are skipped")
    rows = []
    for seqs, tokens in points:
        for impl in prefill_impls(has_fla):

            def measure(seqs=seqs, tokens=tokens, impl=impl) -> tuple:
                res = bench_gdn_prefill(seqs, tokens, impl, **GDN_SHAPE)
                return res["bytes"], res["us"], {"host_us": res["host_us"]}

            shape = dict(batch=seqs, tokens=tokens, **GDN_SHAPE, state="float32")
            what = f"gdn_prefill {impl} {seqs}x{tokens}"
            rows.append(measured_row("gdn_prefill", impl, what, shape, errors, measure))
    return rows


def bench_gemm(
    rows_list: list[int],
    errors: list[str],
    sweep: bool | str | None = False,
    shapes: list[tuple[int, int]] = GEMM_SHAPES,
) -> list[dict]:
    """Decode GEMM rows per shape and row count: ours (what the engine runs, `triton`; the base
    kernel, `triton-base`; the split-K kernel where its configuration splits K, `triton-splitk`)
    and cuBLAS (F.linear), and at one row the GEMV kernel (`triton-gemv`); with `sweep` (True
    or "all"; "splitk" or "base": one of the two), the fastest split-K configuration of the
    sweep (`triton-best`) on the 35B-A3B shapes at 1 row and the 9B shapes at 1 and 64 rows, and the
    fastest of the base kernel's tuner configurations (`triton-base-best`, each timed as the
    rows are) at 1, 16 and 64 rows (its wide list at 64). Above 16 rows `triton` is what the
    engine runs (the base kernel's wide tiles, or cuBLAS by shape), `triton-base` the base
    kernel's wide tiles and `triton-splitk` the split-K kernel's. On NORM_GEMM_SHAPES up to 16
    rows, the residual add +
    RMSNorm fused into the GEMM (`triton-norm`) and the engine's two kernels (`norm+triton`),
    and at one row the norm in the GEMV's launch (`triton-gemv-norm`)."""
    from deltaserve.ops.linear.triton_bench import (
        IMPLS,
        NORM_IMPLS,
        ONE_ROW_IMPLS,
        ONE_ROW_NORM_IMPLS,
        bench_decode_gemm,
    )
    from deltaserve.ops.linear.triton_gemm import base_configs, wide_base_configs
    from deltaserve.ops.linear.triton_splitk import sweep_configs

    sweep_splitk = sweep in (True, "all", "splitk")
    sweep_base = sweep in (True, "all", "base")
    rows = []
    for n, k in shapes:
        for m in rows_list:
            runs = [(impl, None) for impl in IMPLS]
            if m == 1:
                runs += [(impl, None) for impl in ONE_ROW_IMPLS]
            if (n, k) in NORM_GEMM_SHAPES and m <= 16:
                runs += [(impl, None) for impl in NORM_IMPLS]
                if m == 1:
                    runs += [(impl, None) for impl in ONE_ROW_NORM_IMPLS]
            if sweep_splitk and (
                ((n, k) in GEMM_SHAPES_35B and m == 1)
                or ((n, k) in GEMM_SHAPES_9B and m in (1, 64))
            ):
                runs.append(("triton-best", sweep_configs(m, n, k)))
            if sweep_base and m in (1, 16):
                runs.append(("triton-base-best", base_configs()))
            if sweep_base and m == 64:
                runs.append(("triton-base-best", wide_base_configs(m)))
            for impl, configs in runs:

                def measure(m=m, n=n, k=k, impl=impl, configs=configs) -> tuple:
                    res = bench_decode_gemm(m, n, k, impl.removesuffix("-best"), configs=configs)
                    extra = {key: res[key] for key in ("config", "sweep") if key in res}
                    return res["bytes"], res["us"], extra

                shape = dict(batch=m, n=n, k=k)
                row = measured_row("gemm", impl, f"gemm {impl} {shape}", shape, errors, measure)
                rows.append(row)
                # progress on stderr: a run cut short by a time limit still leaves its figures
                us = "error" if row["us"] is None else f"{row['us']:.1f} us"
                print(f"gemm {m}x{n}x{k} {impl}: {us} {row.get('config', '')}", file=sys.stderr)
    return rows


def bench_moe_rows(tokens_list: list[int], errors: list[str], tp: int = 1) -> list[dict]:
    """MoE rows: every `moe` backend per token count, on the same weights and routing (each
    expert's intermediate split as one rank of tensor parallelism `tp` holds it)."""
    from deltaserve.ops.moe.triton_bench import (
        bench_moe,
        make_layers,
        make_weights,
        moe_impls,
        rank_shape,
        triton_path,
    )

    shape = rank_shape(tp)
    weights = make_weights(shape=shape)
    rows = []
    for tokens in tokens_list:
        layers = make_layers(tokens, weights)
        for impl in moe_impls(tokens):
            path = triton_path(tokens) if impl == "triton" else ""
            path = impl.removeprefix("triton-") if impl.startswith("triton-") else path

            def measure(tokens=tokens, impl=impl, layers=layers) -> tuple:
                res = bench_moe(tokens, impl, layers)
                tflop_s = res["flops"] / (res["us"] * 1e-6) / 1e12
                return res["bytes"], res["us"], {"experts": res["experts"], "tflop_s": tflop_s}

            where = dict(batch=tokens, inter=shape["inter"], path=path)
            what = f"moe {impl} T={tokens}"
            rows.append(measured_row("moe", impl, what, where, errors, measure))
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "error" if x is None else format(x, spec)


def _family_table(rows: list[dict], title: str, shape: list, extra: list = ()) -> list[str]:
    """One family's markdown table. `shape` / `extra`: (header, alignment, cell function)
    columns before `impl` / after `x ours`; the shape cells also key the ratio to our Triton
    row of the same shape."""

    def key(r: dict) -> tuple:
        return tuple(cell(r) for _, _, cell in shape)

    ours = {key(r): r["us"] for r in rows if r["impl"] == "triton" and r["us"]}
    heads = [h for h, _, _ in shape] + ["impl", "us", "TB/s", "floor us", "% of floor", "x ours"]
    aligns = [a for _, a, _ in shape] + ["---"] + ["---:"] * 5
    heads += [h for h, _, _ in extra]
    aligns += [a for _, a, _ in extra]
    out = [title, "", "| " + " | ".join(heads) + " |", "| " + " | ".join(aligns) + " |"]
    for r in rows:
        ratio = r["us"] / ours[key(r)] if r["us"] and key(r) in ours else None
        cells = [cell(r) for _, _, cell in shape] + [
            r["impl"],
            _fmt(r["us"], ".1f"),
            _fmt(r.get("tb_s"), ".2f"),
            _fmt(r["floor_us"], ".1f"),
            _fmt(r.get("pct_floor"), ".0f"),
            _fmt(ratio, ".2f"),
        ]
        cells += [cell(r) for _, _, cell in extra]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return [*out, ""]


def format_tables(rows: list[dict]) -> str:
    """Markdown tables, one per family, with each row's ratio to our Triton kernel."""
    out: list[str] = []
    gdn = [r for r in rows if r["family"] == "gdn"]
    if gdn:
        out += _family_table(
            gdn,
            "GDN decode, one layer: HV=32, HK=16, K=V=128, bf16 activations (bytes: the "
            "state read and written in the pool's dtype, fla's in float32, + activations)",
            [("state", "---", lambda r: r["state"]), ("batch", "---:", lambda r: r["batch"])],
        )
    prefill = [r for r in rows if r["family"] == "gdn_prefill"]
    if prefill:
        out += _family_table(
            prefill,
            "GDN prefill, one layer call: HV=32, HK=16, K=V=128, bf16 activations, float32 "
            "pool, every row continuing a state (us: device time per call; host us: the "
            "host's time to issue it, device not waited on; a step costs about 24 x the larger)",
            [
                ("seqs x tokens", "---", lambda r: f"{r['batch']} x {r['tokens']}"),
            ],
            [("host us", "---:", lambda r: _fmt(r.get("host_us"), ".1f"))],
        )
    attn = [r for r in rows if r["family"] == "attention"]
    if attn:
        out += _family_table(
            attn,
            "Paged decode attention, bf16, page 16 (bytes: K + V of every sequence, q and out)",
            [
                ("Hq/Hkv x D", "---", lambda r: f"{r['hq']}/{r['hkv']} x {r['head_dim']}"),
                ("batch", "---:", lambda r: r["batch"]),
                ("context", "---:", lambda r: r["context"]),
            ],
        )
    gemm = [r for r in rows if r["family"] == "gemm"]
    if gemm:
        out += _family_table(
            gemm,
            "Decode GEMM x [rows, K] @ W [N, K].T, bf16, weights cycled past L2 (bytes: W + x "
            "+ out; triton-norm / triton-gemv-norm / norm+triton: the residual add + RMSNorm "
            "over x first, fused or as its own kernel, + the residual read and written and "
            "the norm weight)",
            [
                ("N x K", "---", lambda r: f"{r['n']} x {r['k']}"),
                ("rows", "---:", lambda r: r["batch"]),
            ],
            [("config", "---", lambda r: r.get("config", ""))],
        )
    moe = [r for r in rows if r["family"] == "moe"]
    if moe:
        out += _family_table(
            moe,
            "MoE routed experts, one layer: hidden 2048, 256 experts, top-8, bf16, routing from "
            "peaky router logits included (bytes: the distinct selected experts' weights + x, "
            "logits, out); expert intermediate 512, or a tensor-parallel rank's share of it",
            [
                ("tokens", "---:", lambda r: r["batch"]),
                ("inter", "---:", lambda r: r.get("inter", "")),
            ],
            [
                ("TFLOP/s", "---:", lambda r: _fmt(r.get("tflop_s"), ".1f")),
                ("experts", "---:", lambda r: _fmt(r.get("experts"), ".1f")),
                ("path", "---", lambda r: r.get("path", "")),
            ],
        )
    mla = [r for r in rows if r["family"] == "mla"]
    if mla:
        from deltaserve.bench.mla_kernels import format_mla_table

        out += format_mla_table(mla)
    return "\n".join(out)


def handler(args: argparse.Namespace) -> int:
    """Measure the device's ceilings, then every kernel family asked for; print and save."""
    import torch

    if not torch.cuda.is_available():
        print("deltaserve bench kernels: needs a CUDA device")
        return 2
    from deltaserve.bench import floors
    from deltaserve.bench.provenance import provenance

    # NOTE: measured first, with the GPU to itself; the matmul rate is measured too (a second)
    # so that the JSON carries both ceilings of the device.
    ceilings = floors.resolve_ceilings(True, args.copy_bw, None)
    # F.linear's library (the `cublas` rows) as the engine sets it when a model loads
    from deltaserve.engine.model_instance import set_blas_library

    blas = set_blas_library(torch.device("cuda")) or "PyTorch's choice"
    errors: list[str] = []
    rows: list[dict] = []
    if args.only in (None, "gdn"):
        rows += bench_gdn(GDN_BATCHES_QUICK if args.quick else GDN_BATCHES, errors)
    if args.only in (None, "gdn_prefill"):
        rows += bench_gdn_prefill_rows(GDN_PREFILL_POINTS, errors)
    if args.only in (None, "attention"):
        from deltaserve.bench.attention_kernels import (
            ATTN_POINTS,
            ATTN_POINTS_QUICK,
            bench_attention,
        )

        rows += bench_attention(ATTN_POINTS_QUICK if args.quick else ATTN_POINTS, errors)
    if args.only in (None, "gemm"):
        gemm_rows = args.gemm_rows or (GEMM_ROWS_QUICK if args.quick else GEMM_ROWS)
        shapes = {"all": GEMM_SHAPES, "9b": GEMM_SHAPES_9B, "35b": GEMM_SHAPES_35B}
        rows += bench_gemm(gemm_rows, errors, args.gemm_sweep, shapes[args.gemm_shapes])
    if args.only in (None, "moe"):
        moe_tokens = args.moe_tokens or (MOE_TOKENS_QUICK if args.quick else MOE_TOKENS)
        rows += bench_moe_rows(moe_tokens, errors, args.moe_tp)
    if args.only in (None, "mla"):
        from deltaserve.bench.mla_kernels import MLA_POINTS, MLA_POINTS_QUICK, bench_mla_rows

        rows += bench_mla_rows(
            MLA_POINTS_QUICK if args.quick else MLA_POINTS, errors, args.mla_variants,
            args.mla_heads,
        )  # fmt: skip
    device = torch.cuda.get_device_name()
    add_floors(rows, ceilings.copy_bytes_per_s)
    print(f"device: {device}; floor = bytes / {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s")
    print(f"ceilings: {ceilings.describe()}; F.linear through {blas}\n")
    print(format_tables(rows))
    for e in errors:
        print(f"error: {e}")
    if args.json:
        report = dict(
            **provenance(),
            device=device,
            ceilings=ceilings.as_dict(),
            blas_library=blas,
            rows=rows,
            errors=errors,
        )
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if any(r["us"] for r in rows) else 1
