"""`deltaserve bench kernels` on CPU: rows get their floors from the copy ceiling they are given
(the measurement itself needs a GPU), error rows stay errors, the tables show both."""

from __future__ import annotations

import pytest

from deltaserve.bench.kernels import add_floors, format_tables, kernel_row


def test_floors_follow_the_copy_ceiling() -> None:
    rows = [
        kernel_row("gemm", "triton", 2e6, 1.0, batch=1, n=1000, k=1000),
        kernel_row("gemm", "cublas", 2e6, 2.0, batch=1, n=1000, k=1000),
        kernel_row("gemm", "bad", None, None, batch=1, n=1000, k=1000, error="boom"),
    ]
    add_floors(rows, copy_bw=4e12)  # 2 MB at 4 TB/s: 0.5 us
    ours, cublas, bad = rows
    assert ours["floor_us"] == pytest.approx(0.5) and ours["pct_floor"] == pytest.approx(50.0)
    assert ours["tb_s"] == pytest.approx(2.0)
    assert cublas["pct_floor"] == pytest.approx(25.0)
    assert bad["floor_us"] is None and "pct_floor" not in bad
    add_floors(rows, copy_bw=2e12)  # a slower device: the same times are nearer its floor
    assert ours["pct_floor"] == pytest.approx(100.0)
    table = format_tables(rows)
    assert "| 1000 x 1000 | 1 | triton | 1.0 | 2.00 | 1.0 | 100 | 1.00 |" in table
    assert "| 1000 x 1000 | 1 | cublas | 2.0 | 1.00 | 1.0 | 50 | 2.00 |" in table
    assert "| 1000 x 1000 | 1 | bad | error | error | error | error | error |" in table


def test_moe_table_shows_tflops_experts_and_path() -> None:
    from deltaserve.ops.moe.triton_bench import moe_impls, triton_path

    ours = kernel_row("moe", "triton", 4e6, 2.0, batch=1, inter=256, path="decode")
    ours.update(experts=8.0, tflop_s=3.5)
    other = kernel_row("moe", "grouped_mm", 4e6, 4.0, batch=1, inter=256, path="")
    other.update(experts=8.0, tflop_s=1.75)
    rows = [ours, other]
    add_floors(rows, copy_bw=4e12)  # 4 MB at 4 TB/s: 1 us
    table = format_tables(rows)
    assert "| 1 | 256 | triton | 2.0 | 2.00 | 1.0 | 50 | 1.00 | 3.5 | 8.0 | decode |" in table
    assert "| 1 | 256 | grouped_mm | 4.0 | 1.00 | 1.0 | 25 | 2.00 | 1.8 | 8.0 |  |" in table
    # top-8: the decode path up to 16 tokens, where the forced sorted path gets a row too; the
    # forced decode path up to 64 tokens
    assert triton_path(16) == "decode" and triton_path(17) == "sorted"
    # one token: the tile kernels beside the one-token GEMV kernels "triton" runs
    assert moe_impls(1) == ["triton", "triton-sorted", "triton-tile", "grouped_mm", "torch"]
    assert moe_impls(16) == ["triton", "triton-sorted", "grouped_mm", "torch"]
    assert moe_impls(32) == ["triton", "triton-decode", "grouped_mm", "torch"]
    assert moe_impls(65) == ["triton", "grouped_mm", "torch"]


def test_moe_rank_shape_splits_the_expert_intermediate() -> None:
    """`bench kernels --only moe --moe-tp N`: one rank's experts under TP=N (layers/moe.py)."""
    from deltaserve.bench.kernels import add_parser
    from deltaserve.ops.moe.triton_bench import SHAPE, rank_shape

    assert rank_shape(1) == SHAPE
    assert rank_shape(2) == dict(SHAPE, inter=256) and SHAPE["inter"] == 512
    with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide inter 512"):
        rank_shape(3)
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["kernels", "--only", "moe", "--moe-tp", "2"])
    assert args.moe_tp == 2 and parser.parse_args(["kernels"]).moe_tp == 1


def test_gdn_table_compares_within_each_state_dtype() -> None:
    rows = [
        kernel_row("gdn", "triton", 2e6, 1.0, batch=8, state="float32"),
        kernel_row("gdn", "flashinfer", 2e6, 2.0, batch=8, state="float32"),
        kernel_row("gdn", "triton", 1e6, 0.5, batch=8, state="bfloat16"),
        kernel_row("gdn", "flashinfer", 1e6, 0.25, batch=8, state="bfloat16"),
    ]
    add_floors(rows, copy_bw=4e12)
    table = format_tables(rows)
    assert "| float32 | 8 | flashinfer | 2.0 | 1.00 | 0.5 | 25 | 2.00 |" in table
    assert "| bfloat16 | 8 | flashinfer | 0.2 | 4.00 | 0.2 | 100 | 0.50 |" in table


def test_gdn_impls_say_why_flashinfer_is_left_out(monkeypatch) -> None:
    import deltaserve.backend_checks as backend_checks
    from deltaserve.bench.kernels import gdn_impls

    errors: list[str] = []
    monkeypatch.setattr(backend_checks, "package_installed", lambda name: False)
    assert gdn_impls("float32", errors) == ["triton", "fla", "torch"]
    assert gdn_impls("bfloat16", errors) == ["triton"]
    assert errors == [
        "gdn float32: flashinfer not installed, its rows are skipped",
        "gdn bfloat16: flashinfer not installed, its rows are skipped",
    ]
    monkeypatch.setattr(backend_checks, "package_installed", lambda name: True)
    monkeypatch.setattr(backend_checks, "flashinfer_gdn_kernel_reason", lambda state: "no CuTe DSL")
    assert gdn_impls("bfloat16", errors) == ["triton"]
    assert errors[-1] == "gdn bfloat16: flashinfer rows skipped: no CuTe DSL"
    monkeypatch.setattr(backend_checks, "flashinfer_gdn_kernel_reason", lambda state: None)
    assert gdn_impls("bfloat16", errors) == ["triton", "flashinfer"]


def test_gdn_prefill_table_shows_host_time_and_ratio_to_ours() -> None:
    ours = kernel_row("gdn_prefill", "triton", 4e6, 100.0, batch=16, tokens=171, state="float32")
    ours["host_us"] = 20.0
    fla = kernel_row("gdn_prefill", "fla", 4e6, 50.0, batch=16, tokens=171, state="float32")
    fla["host_us"] = 1600.0
    rows = [ours, fla]
    add_floors(rows, copy_bw=4e12)  # 4 MB at 4 TB/s: 1 us
    table = format_tables(rows)
    assert "| 16 x 171 | triton | 100.0 | 0.04 | 1.0 | 1 | 1.00 | 20.0 |" in table
    assert "| 16 x 171 | fla | 50.0 | 0.08 | 1.0 | 2 | 0.50 | 1600.0 |" in table


def test_gdn_prefill_impls_and_their_backends() -> None:
    pytest.importorskip("triton")
    from deltaserve.ops.gdn.prefill_bench import TRITON_TILINGS, make_backend, prefill_impls

    assert prefill_impls(False)[0] == "triton"
    assert prefill_impls(True)[:3] == ["fla", "fla-split", "triton"]
    assert len(prefill_impls(False)) == 2 + len(TRITON_TILINGS)
    assert prefill_impls(False)[1] == "triton-chunked"
    assert "triton-bv8-w1-ck128" in prefill_impls(False)
    assert "triton-bv16-w2-ck32-rows" in prefill_impls(False)
    variant = make_backend("triton-bv16-w2-ck32-rows")
    assert variant.name == "triton" and variant.tiling == TRITON_TILINGS[3]
    assert make_backend("triton").tiling is None
    with pytest.raises(ValueError, match="unknown GDN prefill impl 'nope'"):
        make_backend("nope")


def test_measured_row_keeps_going_after_an_error() -> None:
    from deltaserve.bench.kernels import measured_row

    errors: list[str] = []
    ok = measured_row("gdn", "triton", "gdn triton B=1", {"batch": 1}, errors,
                      lambda: (2e6, 1.0, {"host_us": 3.0}))  # fmt: skip
    assert ok == dict(family="gdn", impl="triton", batch=1, host_us=3.0, us=1.0, bytes=2e6,
                      tb_s=pytest.approx(2.0))  # fmt: skip

    def boom() -> tuple:
        raise RuntimeError("no kernel")

    bad = measured_row("gdn", "fla", "gdn fla B=1", {"batch": 1}, errors, boom)
    assert bad == dict(family="gdn", impl="fla", batch=1, error="no kernel", us=None, bytes=None)
    assert errors == ["gdn fla B=1: RuntimeError: no kernel"]


def test_gemm_sweep_times_every_base_configuration_at_1_16_and_64_rows(monkeypatch) -> None:
    """`--gemm-sweep` adds a `triton-base-best` row per shape at 1, 16 and 64 rows, timed over
    the base kernel's tuner configurations (its wide list at 64), next to the tuner's own
    choice (`triton-base`)."""
    from deltaserve.bench import kernels
    from deltaserve.ops.linear import triton_bench
    from deltaserve.ops.linear.triton_gemm import base_configs, wide_base_configs

    calls = []

    def fake(m, n, k, impl, configs=None) -> dict:
        calls.append((m, n, k, impl, configs))
        return {"us": 1.0, "bytes": 1.0, "config": impl, "sweep": [] if configs else None}

    monkeypatch.setattr(triton_bench, "bench_decode_gemm", fake)
    rows = kernels.bench_gemm([1, 16, 64], [], sweep=True)
    best = [r for r in rows if r["impl"] == "triton-base-best"]
    assert sorted((r["batch"], r["n"], r["k"]) for r in best) == sorted(
        (m, n, k) for m in (1, 16, 64) for n, k in kernels.GEMM_SHAPES
    )
    swept = [c for c in calls if c[3] == "triton-base" and c[4]]
    assert len(swept) == len(best)
    assert all(len(c[4]) == len(base_configs()) for c in swept if c[0] <= 16)
    assert all(len(c[4]) == len(wide_base_configs(64)) for c in swept if c[0] == 64)
    # the tuner's own row is there at every row count
    assert {c[0] for c in calls if c[3] == "triton-base" and not c[4]} == {1, 16, 64}
    # one sweep only: `--gemm-sweep base` times no split-K sweep, `splitk` no base one
    only_base = kernels.bench_gemm([1, 64], [], sweep="base", shapes=kernels.GEMM_SHAPES_9B)
    assert {r["impl"] for r in only_base} >= {"triton-base-best"}
    assert "triton-best" not in {r["impl"] for r in only_base}
    only_splitk = kernels.bench_gemm([1], [], sweep="splitk", shapes=kernels.GEMM_SHAPES_9B)
    assert "triton-best" in {r["impl"] for r in only_splitk}
    assert "triton-base-best" not in {r["impl"] for r in only_splitk}


def test_gemm_rows_with_the_norm_only_after_a_norm_and_up_to_16_rows(monkeypatch) -> None:
    """`bench kernels --only gemm` times the norm fused into the GEMM (triton-norm) and the
    two kernels it replaces (norm+triton) on the projections that follow a norm, up to 16 rows;
    the other impls' rows are those it timed before."""
    from deltaserve.bench import kernels
    from deltaserve.ops.linear import triton_bench

    calls = []

    def fake(m, n, k, impl, configs=None) -> dict:
        calls.append((m, n, k, impl))
        return {"us": 1.0, "bytes": 1.0, "config": impl}

    monkeypatch.setattr(triton_bench, "bench_decode_gemm", fake)
    rows = kernels.bench_gemm([1, 16, 32], [])
    assert set(kernels.NORM_GEMM_SHAPES) <= set(kernels.GEMM_SHAPES)
    norm = [c for c in calls if c[3] in triton_bench.NORM_IMPLS]
    want = {(m, n, k) for m in (1, 16) for n, k in kernels.NORM_GEMM_SHAPES}
    assert sorted(norm) == sorted((*p, impl) for p in want for impl in triton_bench.NORM_IMPLS)
    gemv_norm = [c for c in calls if c[3] in triton_bench.ONE_ROW_NORM_IMPLS]
    assert sorted(gemv_norm) == sorted(
        (1, n, k, "triton-gemv-norm") for n, k in kernels.NORM_GEMM_SHAPES
    )
    everything_normed = triton_bench.NORM_IMPLS + triton_bench.ONE_ROW_NORM_IMPLS
    plain = [c for c in calls if c[3] not in everything_normed]
    # at 32 rows too: triton (the engine's choice), triton-base, triton-splitk and cublas; at
    # one row also the GEMV
    assert len(plain) == len(kernels.GEMM_SHAPES) * (4 + 4 + 4 + 1)
    gemv = [c for c in calls if c[3] in triton_bench.ONE_ROW_IMPLS]
    assert sorted(gemv) == sorted((1, n, k, "triton-gemv") for n, k in kernels.GEMM_SHAPES)
    impls = {*triton_bench.IMPLS, *triton_bench.NORM_IMPLS, *triton_bench.ONE_ROW_IMPLS}
    impls |= set(triton_bench.ONE_ROW_NORM_IMPLS)
    assert {r["impl"] for r in rows} == impls


def test_gemm_triton_row_names_the_engines_choice_above_16_rows() -> None:
    """The `triton` row is the engine's backend object: above 16 rows it names cuBLAS for a
    weight of more than WIDE_TRITON_MAX_N output rows and the base kernel otherwise."""
    import torch

    from deltaserve.ops.linear import triton_gemm as tg
    from deltaserve.ops.linear.triton_bench import _runs

    gemm = tg.TritonDecodeGemm("auto", max_rows=64)
    x = torch.zeros(17, 8)
    assert _runs(x, torch.zeros(tg.WIDE_TRITON_MAX_N + 1, 8), gemm) == "cuBLAS"
    assert _runs(x, torch.zeros(tg.WIDE_TRITON_MAX_N, 8), gemm).startswith("base: ")
    assert _runs(x[:16], torch.zeros(tg.WIDE_TRITON_MAX_N + 1, 8), gemm).startswith("base: ")
    assert _runs(x, torch.zeros(64, 8), "splitk").startswith("split-K: ")
