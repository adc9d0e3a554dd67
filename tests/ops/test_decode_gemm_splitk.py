"""The split-K decode GEMM (ops/linear/triton_splitk.py) against the float32 torch reference:
on CPU in Triton's interpreter at awkward sizes with explicit configurations (dot and FMA tiles,
SPLIT_K 1..8 with a ragged last slice, with and without prefetch, bias, a strided x, outputs
and workspace poisoned), the arrival counters back at 0 after every call (the next call, or a
CUDA-graph replay, needs no memset), the configuration chosen from the shape, the kernel
switch; on the GPU (`pytest -m gpu`) the Qwen3.5-35B-A3B / 9B decode shapes with the chosen and
every swept configuration, and replays of a CUDA graph."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_helpers import kernel_device, requires_triton  # noqa: E402
from moe_cases import poisoned_empty  # noqa: E402

pytestmark = requires_triton


def _inputs(M, N, K, dtype, device, bias: bool, strided: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + M * 1000 + N * 10 + K)
    x_full = torch.randn(M, K + (5 if strided else 0), generator=gen)
    x = x_full[:, 2 : 2 + K] if strided else x_full  # row stride K + 5
    w = torch.randn(N, K, generator=gen) / K**0.5
    b = torch.randn(N, generator=gen) if bias else None
    x, w = x.to(device, dtype), w.to(device, dtype)
    return x, w, (b.to(device, dtype) if b is not None else None)


def _check(got, x, w, b, tol=1e-2):
    want = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    assert got.shape == want.shape and got.dtype == x.dtype
    assert not got.isnan().any(), "an output was never written"
    err = (got.float() - want).abs().max().item()
    scale = want.abs().max().item() + 1e-6
    assert err <= tol * scale, f"max error {err:.3e} vs scale {scale:.3e}"


def _counters_all_zero() -> bool:
    from deltaserve.ops.tile_counters import all_counters

    return all(int(c.abs().sum()) == 0 for c in all_counters())


def _cpu_dtype():
    return torch.float16 if kernel_device().type == "cpu" else torch.bfloat16


# (M, N, K, config fields): K not a multiple of the slices (ragged last slice), N not of the tile
CASES = [
    (1, 37, 130, dict(block_n=16, block_k=32, split_k=4)),
    (1, 40, 130, dict(block_n=16, block_k=32, split_k=2, fma=True)),
    (1, 40, 130, dict(block_n=16, block_k=32, split_k=2, fma=True, prefetch=True)),
    (3, 50, 200, dict(block_n=32, block_k=32, split_k=4, fma=True, prefetch=True)),
    (2, 21, 70, dict(block_n=16, block_k=16, split_k=1, prefetch=True)),
    (4, 20, 64, dict(block_n=16, block_k=16, split_k=8, fma=True)),
    (2, 33, 96, dict(block_n=16, block_k=32, split_k=8)),  # 8 asked, 3 slices of 32 made
    (16, 33, 100, dict(block_n=32, block_k=32, split_k=1)),
    (9, 17, 300, dict(block_n=16, block_k=64, split_k=2)),
    (17, 40, 130, dict(block_n=32, block_k=32, split_k=4)),  # wide tiles: x padded to 32 rows
    (64, 70, 96, dict(block_n=64, block_k=32, split_k=2)),  # 64 rows
    (45, 33, 64, dict(block_n=16, block_k=32, split_k=1)),
]


@pytest.mark.parametrize("M,N,K,fields", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_splitk_matches_reference(M, N, K, fields, bias):
    from deltaserve.ops.linear.triton_splitk import SplitKConfig, decode_gemm_splitk

    x, w, b = _inputs(M, N, K, _cpu_dtype(), kernel_device(), bias, strided=(M == 3))
    with poisoned_empty():  # output and workspace NaN until written
        got = decode_gemm_splitk(x, w, b, SplitKConfig(**fields))
    _check(got, x, w, b)
    assert _counters_all_zero()


def test_splitk_repeated_calls_are_identical_and_leave_counters_at_zero():
    """The counters reset themselves: a second call on the same weight (same counters) gives
    the same bits (partials summed in split order, whoever arrives last)."""
    from deltaserve.ops.linear.triton_splitk import SplitKConfig, decode_gemm_splitk

    x, w, b = _inputs(2, 45, 256, _cpu_dtype(), kernel_device(), True, False)
    cfg = SplitKConfig(16, 32, 4)
    first = decode_gemm_splitk(x, w, b, cfg)
    assert _counters_all_zero()
    second = decode_gemm_splitk(x, w, b, cfg)
    assert torch.equal(first, second)
    _check(second, x, w, b)


def test_splitk_default_config_and_zero_rows():
    from deltaserve.ops.linear.triton_splitk import decode_gemm_splitk

    x, w, b = _inputs(2, 70, 96, _cpu_dtype(), kernel_device(), True, False)
    _check(decode_gemm_splitk(x, w, b), x, w, b)
    assert decode_gemm_splitk(x[:0], w).shape == (0, 70)


def test_splitk_rejects_bad_input():
    from deltaserve.ops.linear.triton_splitk import SplitKConfig, decode_gemm_splitk

    x, w, _ = _inputs(5, 16, 32, _cpu_dtype(), kernel_device(), False, False)
    with pytest.raises(ValueError, match="FMA tile serves at most 4 rows"):
        decode_gemm_splitk(x, w, None, SplitKConfig(16, 32, 1, fma=True))
    with pytest.raises(ValueError, match="bad split-K configuration"):
        decode_gemm_splitk(x, w, None, SplitKConfig(16, 32, 16))
    with pytest.raises(ValueError, match="features"):
        decode_gemm_splitk(x[:, :31], w)


def test_choose_config_splits_few_column_tiles():
    """On 132 SMs: the MoE in_proj (N 1281) and o_proj / out_proj (N 2048) get split K; the
    GDN in_proj (N 12352), the attention qkv and the 9B's N = 4096 (256 tiles: enough) do
    not; no slice is shorter than a K step."""
    from deltaserve.ops.linear.triton_splitk import choose_config

    assert choose_config(1, 1281, 2048, 132).split_k == 4  # 81 tiles -> 324 programs
    assert choose_config(1, 2048, 4096, 132).split_k == 4  # 128 tiles -> 512
    assert choose_config(1, 2048, 512, 132).split_k == 2  # slices of one 256 step
    assert choose_config(1, 12352, 2048, 132).split_k == 1  # 386 tiles of 32
    assert choose_config(1, 9216, 2048, 132).split_k == 1
    assert choose_config(1, 4096, 4096, 132).split_k == 1
    assert choose_config(16, 4096, 12288, 132).split_k == 1
    for n, k in [(1281, 2048), (2048, 4096), (2048, 512), (64, 256), (100, 72)]:
        cfg = choose_config(4, n, k, 132)
        assert k // cfg.split_k >= cfg.block_k or cfg.split_k == 1


def test_kernel_switch(monkeypatch):
    from deltaserve.ops.linear.triton_gemm import TritonDecodeGemm, decode_gemm

    assert TritonDecodeGemm().kernel == "auto"
    for kernel in ("base", "splitk", "auto"):
        monkeypatch.setenv("DELTASERVE_DECODE_GEMM_KERNEL", kernel)
        assert TritonDecodeGemm().kernel == kernel
    monkeypatch.setenv("DELTASERVE_DECODE_GEMM_KERNEL", "fast")
    with pytest.raises(ValueError, match="DELTASERVE_DECODE_GEMM_KERNEL"):
        TritonDecodeGemm()
    x, w, _ = _inputs(1, 8, 16, _cpu_dtype(), kernel_device(), False, False)
    with pytest.raises(ValueError, match="kernel must be one of"):
        decode_gemm(x, w, None, kernel="fast")


# Qwen3.5-35B-A3B's decode projections (GDN in_proj, out_proj / o_proj, attention qkv, MoE
# in_proj, shared down) and two of the 9B's
GPU_SHAPES = [(12352, 2048), (2048, 4096), (9216, 2048), (1281, 2048), (2048, 512), (4096, 12288)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 3, 4, 16, 33, 64])
@pytest.mark.parametrize("N,K", GPU_SHAPES)
def test_splitk_gpu_model_shapes(M, N, K):
    from deltaserve.ops.linear.triton_splitk import decode_gemm_splitk, sweep_configs

    x, w, b = _inputs(M, N, K, torch.bfloat16, "cuda", bias=(N == 1281), strided=(M == 3))
    with poisoned_empty():
        _check(decode_gemm_splitk(x, w, b), x, w, b)
        if M in (1, 4) and (N, K) in ((1281, 2048), (2048, 4096)):  # every swept config
            for cfg in sweep_configs(M, N, K):
                _check(decode_gemm_splitk(x, w, b, cfg), x, w, b)
    assert _counters_all_zero()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_splitk_gpu_graph_replays():
    """Captured once, replayed with new inputs: each replay right (counters reset in-graph)."""
    from deltaserve.ops.linear.triton_splitk import decode_gemm_splitk

    x, w, b = _inputs(2, 1281, 2048, torch.bfloat16, "cuda", True, False)
    decode_gemm_splitk(x, w, b)  # warm-up: compile, counters allocated
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_gemm_splitk(x, w, b)
    for i in range(5):
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(x.dtype) * (i + 1))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, x, w, b)
    assert _counters_all_zero()


def test_backend_runs_splitk_only_where_its_config_splits(monkeypatch):
    """decode_gemm(kernel="splitk"): the split-K kernel for shapes whose configuration splits
    K (few column tiles: here 3 tiles on CPU's stand-in of 8 SMs, K long enough), the base
    kernel for the others; kernel="base": the base kernel for both; kernel="auto" (the
    default): the GEMV at one row (test_decode_gemv.py), the base kernel's wide tiles above 16
    rows (the split-K kernel's with kernel="splitk"); all give the reference's result. The
    backend object sends 17+ rows of a weight of more than WIDE_TRITON_MAX_N output rows to
    F.linear."""
    from deltaserve.ops.linear import triton_gemm, triton_splitk

    used = []
    real_split, real_base = triton_splitk.decode_gemm_splitk, triton_gemm.decode_gemm_base
    monkeypatch.setattr(
        triton_splitk, "decode_gemm_splitk",
        lambda *a, **k: used.append("splitk") or real_split(*a, **k),
    )  # fmt: skip
    monkeypatch.setattr(
        triton_gemm, "decode_gemm_base", lambda *a: used.append("base") or real_base(*a)
    )
    dev, dtype = kernel_device(), _cpu_dtype()
    for n, k, want in [(37, 130, "base"), (33, 1024, "splitk")]:
        x, w, b = _inputs(1, n, k, dtype, dev, True, False)
        assert (triton_splitk.config_for(x, w).split_k > 1) == (want == "splitk")
        used.clear()
        _check(triton_gemm.decode_gemm(x, w, b, "splitk"), x, w, b)
        assert used == [want]
        used.clear()
        _check(triton_gemm.decode_gemm(x, w, b, "base"), x, w, b)
        assert used == ["base"]
        used.clear()
        _check(triton_gemm.decode_gemm(x, w, b), x, w, b)  # one row: the GEMV
        assert used == []
    x, w, b = _inputs(17, 33, 64, dtype, dev, True, False)
    for kernel, want in (("auto", "base"), ("splitk", "splitk")):
        used.clear()
        with poisoned_empty():
            _check(triton_gemm.decode_gemm(x, w, b, kernel), x, w, b)
        assert used == [want]
    gemm = triton_gemm.TritonDecodeGemm("auto", max_rows=64)
    monkeypatch.setattr(triton_gemm, "WIDE_TRITON_MAX_N", 32)  # w has 33 output rows
    used.clear()
    _check(gemm(x, w, b), x, w, b)
    assert used == []  # F.linear
    _check(gemm(x[:16], w, b), x[:16], w, b)  # up to 16 rows: the base kernel still
    assert used == ["base"]
    monkeypatch.setattr(triton_gemm, "WIDE_TRITON_MAX_N", 33)
    used.clear()
    _check(gemm(x, w, b), x, w, b)
    assert used == ["base"]


def test_sweep_configs_fit_shared_memory():
    """No swept tile asks for more shared memory than an sm_90 block has: Triton asked 245,760
    bytes (over the 232,448 limit) for BLOCK_N 64, BLOCK_K 512, 4 stages, which the sweep used to
    include; the estimate reproduces that figure and the sweep now leaves it out."""
    from deltaserve.ops.linear.triton_splitk import (
        SWEEP_SMEM_BYTES,
        SplitKConfig,
        smem_estimate,
        sweep_configs,
    )

    assert smem_estimate(SplitKConfig(64, 512, 1)) == 245_760
    for m, n, k in [(1, 2048, 4096), (4, 1281, 2048), (16, 4096, 12288)]:
        cfgs = sweep_configs(m, n, k)
        assert cfgs and all(smem_estimate(c) <= SWEEP_SMEM_BYTES < 232_448 for c in cfgs)
        assert SplitKConfig(64, 512, 1) not in cfgs


def test_wide_rows_switch(monkeypatch):
    """Steps above 16 rows reach the Triton decode GEMM only up to its `max_rows`
    (DELTASERVE_DECODE_GEMM_MAX_ROWS, 64 by default), where the split-K kernel serves them
    (or the base kernel's wide tiles, kernel "base"); the wide tiles' configuration;
    out-of-range values."""
    from deltaserve.ops.linear.triton_gemm import TritonDecodeGemm, decode_gemm
    from deltaserve.ops.linear.triton_splitk import choose_config

    monkeypatch.delenv("DELTASERVE_DECODE_GEMM_MAX_ROWS", raising=False)
    assert TritonDecodeGemm().max_rows == 64
    monkeypatch.setenv("DELTASERVE_DECODE_GEMM_MAX_ROWS", "16")
    assert TritonDecodeGemm().max_rows == 16
    monkeypatch.setenv("DELTASERVE_DECODE_GEMM_MAX_ROWS", "64")
    assert TritonDecodeGemm(kernel="base").max_rows == 64
    for bad in ("8", "65"):
        monkeypatch.setenv("DELTASERVE_DECODE_GEMM_MAX_ROWS", bad)
        with pytest.raises(ValueError, match="DELTASERVE_DECODE_GEMM_MAX_ROWS"):
            TritonDecodeGemm()
    cfg = choose_config(64, 4096, 4096, 132)  # the sweep's fastest at 64 rows: no split
    assert (cfg.block_n, cfg.block_k, cfg.split_k) == (32, 128, 1)
    assert choose_config(64, 12352, 4096, 132).block_n == 64
    x, w, b = _inputs(40, 50, 70, _cpu_dtype(), kernel_device(), True, False)
    with poisoned_empty():
        _check(decode_gemm(x, w, b), x, w, b)  # 40 rows: the split-K kernel
    with poisoned_empty():
        _check(decode_gemm(x, w, b, kernel="base"), x, w, b)  # the base kernel's wide tiles
    with pytest.raises(ValueError, match="at most 64 rows"):
        decode_gemm(torch.cat([x, x]), w, b)
