"""The TMA-fed decode GEMM for 17-64 rows (ops/linear/triton_wide.py) against the float32
product (CPU: Triton's interpreter, float16 / float32, whose descriptor loads misread bfloat16;
GPU: bf16 at the 9B's shapes, every tuner configuration), and the backend object's choice for
17-64 rows (`TritonDecodeGemm.wide_impl`: DELTASERVE_DECODE_GEMM_WIDE)."""

from __future__ import annotations

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


@requires_triton
def test_backend_wide_rule_and_tma(monkeypatch):
    """DELTASERVE_DECODE_GEMM_WIDE=rule (the default): the base kernel up to
    WIDE_TRITON_MAX_N output rows, cuBLAS above; tma: the TMA kernel on every weight, where it
    can run (else a ValueError naming why); tma:NxK,...: on those shapes only; up to 16 rows
    neither applies; a bad setting is refused."""
    from deltaserve import env
    from deltaserve.ops.linear import triton_gemm, triton_wide

    x, w, b = _inputs(40, 48, 64, _dtype(), True)
    gemm = triton_gemm.TritonDecodeGemm("auto", max_rows=64)
    assert gemm.wide == "rule"
    monkeypatch.setattr(triton_gemm, "WIDE_TRITON_MAX_N", 47)
    assert gemm.wide_impl(x, w) == "cublas" and gemm.uses_cublas(x, w)
    monkeypatch.setattr(triton_gemm, "WIDE_TRITON_MAX_N", 48)
    assert gemm.wide_impl(x, w) == "base" and not gemm.uses_cublas(x, w)
    tma = triton_gemm.TritonDecodeGemm("auto", max_rows=64, wide="tma")
    if triton_gemm.tma_capable(x, w) is not None:
        with pytest.raises(ValueError, match="DELTASERVE_DECODE_GEMM_WIDE=tma: the TMA kernel"):
            tma(x, w, b)
        monkeypatch.setattr(triton_gemm, "tma_capable", lambda x, w: None)  # the interpreter
    ran = []
    real = triton_wide.decode_gemm_tma
    monkeypatch.setattr(triton_wide, "decode_gemm_tma", lambda *a: ran.append(1) or real(*a))
    with poisoned_empty():
        _check(tma(x, w, b), x, w, b)
        _check(tma(x[:16], w, b), x[:16], w, b)  # 16 rows: the base kernel, as always
    assert ran == [1] and tma.wide_impl(x, w) == "tma" and not tma.uses_cublas(x, w)
    some = triton_gemm.TritonDecodeGemm("auto", max_rows=64, wide="tma:48x64,7x9")
    assert some.wide_impl(x, w) == "tma" and some.wide_impl(x, w[:40]) == "base"
    monkeypatch.setenv("DELTASERVE_DECODE_GEMM_WIDE", "tma:48x64")
    assert env.decode_gemm_wide() == "tma:48x64"
    monkeypatch.setenv("DELTASERVE_DECODE_GEMM_WIDE", "fast")
    with pytest.raises(ValueError, match="DELTASERVE_DECODE_GEMM_WIDE must be"):
        env.decode_gemm_wide()
    for bad in ("fast", "rule:48x64"):
        with pytest.raises(ValueError, match="wide decode GEMM must be one of"):
            triton_gemm.TritonDecodeGemm("auto", max_rows=64, wide=bad)


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
def test_backend_tma_in_a_cuda_graph():
    """The backend object with the TMA kernel on a GPU that has it: equal to the float32 product
    in a CUDA graph too, replayed on new inputs."""
    from deltaserve.ops.linear import triton_gemm

    gemm = triton_gemm.TritonDecodeGemm("auto", max_rows=64, wide="tma")
    x, w, b = _inputs(48, 12352, 4096, torch.bfloat16, False)
    if triton_gemm.tma_capable(x, w) is not None:
        pytest.skip(triton_gemm.tma_capable(x, w))
    _check(gemm(x, w, b), x, w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm(x, w, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _check(out, x, w, b)
