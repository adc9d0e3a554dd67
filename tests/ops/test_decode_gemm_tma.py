"""The TMA-fed decode GEMM for 17-64 rows (ops/linear/triton_wide.py) against the float32
product (CPU: Triton's interpreter, float16 / float32, whose descriptor loads misread bfloat16;
GPU: bf16 at the 9B's shapes, every tuner configuration), and the backend object's choice
among cuBLAS, it and the base kernel (`TritonDecodeGemm.wide_impl`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_helpers import kernel_device, requires_triton  # noqa: E402
from moe_cases import poisoned_empty  # noqa: E402


def _dtype() -> torch.dtype:
    return torch.float16 if kernel_device().type == "cpu" else torch.bfloat16


def _inputs(m, n, k, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed * 7919 + m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    dev = kernel_device()
    return x.to(dev), w.to(dev), None if b is None else b.to(dev)


def _check(got, x, w, b, rel=1e-2):
    want = x.float() @ w.float().T + (0 if b is None else b.float())
    assert got.shape == want.shape and got.dtype == x.dtype
    err = (got.float() - want).abs().max().item()
    scale = want.abs().max().item() + 1e-6
    assert err <= rel * scale, f"max error {err} against scale {scale}"


@requires_triton
@pytest.mark.parametrize("m,n,k", [(17, 37, 64), (33, 100, 136), (64, 20, 48), (40, 65, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_tma_gemm_matches_the_product(m, n, k, bias):
    """Rows padded to 32 (the W tile on the MMA's M side) and to 64 (x on it); N not a
    multiple of the tile; K not a multiple of the K tile (the descriptor's zero fill)."""
    from deltaserve.ops.linear.triton_wide import decode_gemm_tma

    x, w, b = _inputs(m, n, k, _dtype(), bias)
    with poisoned_empty():
        _check(decode_gemm_tma(x, w, b), x, w, b)


@requires_triton
def test_tma_gemm_copies_an_unaligned_input_and_rejects_odd_rows():
    """An x whose rows start off a 16-byte boundary (a column slice) is copied before its
    descriptor is made; a K whose rows are not 16-byte multiples is refused by name."""
    from deltaserve.ops.linear.triton_wide import decode_gemm_tma

    dt = _dtype()
    x_full, w, b = _inputs(24, 40, 72, dt, True)
    x = torch.cat([x_full, x_full[:, :3]], dim=1)[:, 3 : 3 + 64]  # row stride 75, offset 3
    w = w[:, :64].contiguous()
    assert x.stride(0) * x.element_size() % 16 != 0
    _check(decode_gemm_tma(x, w, b), x, w, b)
    bad_w = torch.zeros(8, 12, dtype=dt, device=kernel_device())
    with pytest.raises(ValueError, match="multiple of 16"):
        decode_gemm_tma(torch.zeros(20, 12, dtype=dt, device=kernel_device()), bad_w)


@requires_triton
def test_tma_gemm_float32_interpreter_exact_enough():
    """float32 operands (the dtype the interpreter reads without loss): within 1e-4."""
    from deltaserve.ops.linear.triton_wide import decode_gemm_tma

    if kernel_device().type != "cpu":
        pytest.skip("the float32 check is the interpreter's")
    x, w, b = _inputs(50, 70, 64, torch.float32, True)
    _check(decode_gemm_tma(x, w, b), x, w, b, rel=1e-4)


def _recorders(monkeypatch) -> list[str]:
    """The Triton candidates, wrapped to note each run ("tma", "base") in the returned list."""
    from deltaserve.ops.linear import triton_gemm, triton_wide

    ran: list[str] = []
    real_tma, real_base = triton_wide.decode_gemm_tma, triton_gemm.decode_gemm_base
    monkeypatch.setattr(
        triton_wide, "decode_gemm_tma", lambda *a: ran.append("tma") or real_tma(*a)
    )
    monkeypatch.setattr(
        triton_gemm, "decode_gemm_base", lambda *a: ran.append("base") or real_base(*a)
    )
    return ran


def _fake_bench(times: dict[str, float], ran: list[str], timed: list[str]):
    """A graph_bench stand-in: runs the candidate once (as graph_bench's eager call does),
    names it by what it ran (nothing noted: cuBLAS), notes the name in `timed` and returns the
    time `times` gives it, in ms."""

    def bench(fn):  # noqa: ANN001, ANN202
        before = len(ran)
        fn()
        name = ran.pop() if len(ran) > before else "cublas"
        timed.append(name)
        return times[name] / 1e3

    return bench


@requires_triton
@pytest.mark.parametrize("fastest", ["tma", "cublas", "base"])
def test_backend_times_the_candidates_once_and_runs_the_fastest(monkeypatch, caplog, fastest):
    """Under DELTASERVE_DECODE_GEMM_WIDE=measure a 17-64-row call times cuBLAS, the TMA kernel
    and (N <= WIDE_TRITON_MAX_N) the base kernel once per (shape, row padding), logs every
    time, and runs the fastest at that call and later ones; another row padding is timed
    afresh."""
    from deltaserve.ops import graph_bench
    from deltaserve.ops.linear import triton_gemm

    times = {"cublas": 20.0, "tma": 30.0, "base": 40.0}
    times[fastest] = 10.0
    ran = _recorders(monkeypatch)
    timed: list[str] = []
    monkeypatch.setattr(graph_bench, "graph_bench", _fake_bench(times, ran, timed))
    monkeypatch.setattr(triton_gemm, "tma_capable", lambda x, w: None)
    gemm = triton_gemm.TritonDecodeGemm("auto", max_rows=64, wide="measure")
    x, w, b = _inputs(40, 48, 64, _dtype(), True)
    logging.getLogger("deltaserve").addHandler(caplog.handler)  # it does not propagate
    try:
        with caplog.at_level(logging.INFO, logger="deltaserve.ops.linear.triton_gemm"):
            assert gemm.wide_impl(x, w, b) == fastest
    finally:
        logging.getLogger("deltaserve").removeHandler(caplog.handler)
    assert sorted(timed) == ["base", "cublas", "tma"] and ran == []
    assert "decode GEMM, 40 rows (padded to 64), weight 48 x 64: " + fastest in caplog.text
    assert "(cublas 20.0 us, tma 30.0 us, base 10.0 us)" in caplog.text or fastest != "base"
    _check(gemm(x, w, b), x, w, b)
    _check(gemm(x[:35], w, b), x[:35], w, b)  # the same padding (64): not timed again
    assert len(timed) == 3
    assert ran == ([fastest] * 2 if fastest != "cublas" else [])
    timed.clear()
    gemm.wide_impl(x[:20], w, b)  # padded to 32: timed afresh
    assert sorted(timed) == ["base", "cublas", "tma"]
    # a weight of more output rows than WIDE_TRITON_MAX_N: the base kernel is no candidate
    monkeypatch.setattr(triton_gemm, "WIDE_TRITON_MAX_N", 47)
    gemm.wide_choices.clear()
    timed.clear()
    gemm.wide_impl(x, w, b)
    assert sorted(timed) == ["cublas", "tma"]


class _CudaLooking(torch.Tensor):
    """A CPU tensor whose `is_cuda` says True (the capture check's question)."""

    @property
    def is_cuda(self) -> bool:  # noqa: D102
        return True


@requires_triton
def test_backend_refuses_to_time_during_capture(monkeypatch):
    """A shape first seen inside a CUDA-graph capture cannot be timed there: a clear error
    (the warm-up runs every graph bucket eagerly first)."""
    from deltaserve.ops.linear import triton_gemm

    monkeypatch.setattr(triton_gemm, "tma_capable", lambda x, w: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    gemm = triton_gemm.TritonDecodeGemm("auto", max_rows=64, wide="measure")
    x, w, b = _inputs(40, 48, 64, _dtype(), False)
    if not x.is_cuda:  # the check asks CUDA only of CUDA tensors: a stand-in that says so
        x = _CudaLooking(x)
    with pytest.raises(RuntimeError, match="during CUDA-graph capture"):
        gemm(x, w, b)


@requires_triton
def test_backend_wide_rule_and_forced_tma(monkeypatch):
    """Without the TMA kernel (here: the interpreter) `measure` keeps the rule (base kernel up
    to WIDE_TRITON_MAX_N output rows, cuBLAS above); `rule` is that rule everywhere; `tma`
    where the kernel cannot run is a ValueError naming why; a bad setting is refused."""
    from deltaserve import env
    from deltaserve.ops.linear import triton_gemm

    x, w, _ = _inputs(40, 48, 64, _dtype(), False)
    for mode in ("measure", "rule"):
        gemm = triton_gemm.TritonDecodeGemm("auto", max_rows=64, wide=mode)
        if mode == "measure" and triton_gemm.tma_capable(x, w) is None:
            continue  # a GPU with TMA: measured (test_backend_times_the_candidates...)
        monkeypatch.setattr(triton_gemm, "WIDE_TRITON_MAX_N", 47)
        assert gemm.wide_impl(x, w) == "cublas" and gemm.uses_cublas(x, w)
        monkeypatch.setattr(triton_gemm, "WIDE_TRITON_MAX_N", 48)
        assert gemm.wide_impl(x, w) == "base" and not gemm.uses_cublas(x, w)
    if kernel_device().type == "cpu":
        gemm = triton_gemm.TritonDecodeGemm("auto", max_rows=64, wide="tma")
        with pytest.raises(ValueError, match="DELTASERVE_DECODE_GEMM_WIDE=tma: the TMA kernel"):
            gemm(x, w)
    monkeypatch.setenv("DELTASERVE_DECODE_GEMM_WIDE", "fast")
    with pytest.raises(ValueError, match="DELTASERVE_DECODE_GEMM_WIDE must be"):
        env.decode_gemm_wide()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [17, 40, 64])
@pytest.mark.parametrize("n,k", [(12352, 4096), (4096, 12288), (1000, 72), (2048, 512)])
def test_tma_gemm_gpu_every_configuration(m, n, k):
    """bf16 at the 9B's and smaller shapes: the tuner's choice and each configuration against
    the float32 product (PDL on where the GPU has it)."""
    from deltaserve.ops.linear.triton_wide import decode_gemm_tma, tma_configs

    x, w, b = _inputs(m, n, k, torch.bfloat16, m == 40)
    with poisoned_empty():
        _check(decode_gemm_tma(x, w, b), x, w, b)
        for cfg in tma_configs():
            _check(decode_gemm_tma(x, w, b, cfg), x, w, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_backend_measures_on_the_gpu_and_stays_exact():
    """The backend object on a GPU with TMA: the choice is timed for real and whatever it runs
    equals the float32 product, in a CUDA graph too."""
    from deltaserve.ops.linear import triton_gemm

    gemm = triton_gemm.TritonDecodeGemm("auto", max_rows=64, wide="measure")
    x, w, b = _inputs(64, 12352, 4096, torch.bfloat16, False)
    if triton_gemm.tma_capable(x, w) is not None:
        pytest.skip(triton_gemm.tma_capable(x, w))
    _check(gemm(x, w, b), x, w, b)
    impl, us = gemm.wide_choices[next(iter(gemm.wide_choices))]
    assert set(us) == {"cublas", "tma"} and impl == min(us, key=us.get)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm(x, w, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _check(out, x, w, b)
