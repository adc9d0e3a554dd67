"""The one-row decode GEMV (ops/linear/triton_gemv.py) against the float32 torch reference
(CPU: Triton's interpreter at small sizes; GPU: `pytest -m gpu`, the 35B-A3B's and 9B's thin
shapes with the tuner's choice and with every configuration of its list), and its routing in
`decode_gemm` (kernel "auto": one row to the GEMV, more rows to the base kernel)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_helpers import kernel_device, requires_triton  # noqa: E402


def _inputs(N, K, dtype, bias, device, seed=0):
    gen = torch.Generator().manual_seed(seed + N * 7 + K)
    x = torch.randn(1, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    return x.to(device), w.to(device), b.to(device) if b is not None else None


def _assert_close(got, x, w, b):
    want = x.float() @ w.float().T
    if b is not None:
        want = want + b.float()
    assert got.shape == want.shape and got.dtype == x.dtype
    err = (got.float() - want).abs().max().item()
    scale = want.abs().max().item() + 1e-6
    assert err <= 1e-2 * scale, f"max error {err} against scale {scale}"


@requires_triton
@pytest.mark.parametrize("N,K", [(37, 64), (5, 100), (1, 48), (33, 200), (9, 31)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(N, K, bias):
    """Odd N (a partial last column tile), K not a multiple of the chunk (a partial last chunk)
    and K of several chunks (the prefetch chain)."""
    from deltaserve.ops.linear.triton_gemv import decode_gemv

    dtype = torch.float16 if kernel_device().type == "cpu" else torch.bfloat16
    x, w, b = _inputs(N, K, dtype, bias, kernel_device())
    _assert_close(decode_gemv(x, w, b), x, w, b)


@requires_triton
def test_gemv_reads_a_strided_row():
    """x as a column slice of a wider row (unit last stride, any row stride)."""
    from deltaserve.ops.linear.triton_gemv import decode_gemv

    dtype = torch.float16 if kernel_device().type == "cpu" else torch.bfloat16
    _, w, _ = _inputs(40, 96, dtype, False, kernel_device())
    wide = torch.randn(1, 110, generator=torch.Generator().manual_seed(3)).to(dtype)
    x = wide.to(kernel_device())[:, 5:101]
    _assert_close(decode_gemv(x, w), x, w, None)


@requires_triton
def test_gemv_rejects_more_than_one_row():
    from deltaserve.ops.linear.triton_gemv import decode_gemv

    x = torch.zeros(2, 64, dtype=torch.float16, device=kernel_device())
    w = torch.zeros(8, 64, dtype=torch.float16, device=kernel_device())
    with pytest.raises(ValueError, match="at most 1 rows, got 2"):
        decode_gemv(x, w)


@requires_triton
def test_decode_gemm_auto_routes_one_row_to_the_gemv(monkeypatch):
    """kernel "auto" (the backend's default): one row runs the GEMV, three rows the base
    kernel (both exact to the reference); kernel "base" keeps one row on the base kernel."""
    from deltaserve.ops.linear import triton_gemv
    from deltaserve.ops.linear.triton_gemm import TritonDecodeGemm, decode_gemm

    dtype = torch.float16 if kernel_device().type == "cpu" else torch.bfloat16
    calls = []
    real = triton_gemv.decode_gemv
    monkeypatch.setattr(
        triton_gemv, "decode_gemv", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
    )
    x, w, b = _inputs(24, 64, dtype, True, kernel_device())
    _assert_close(decode_gemm(x, w, b), x, w, b)
    x3 = torch.cat([x, x * 0.5, -x])
    _assert_close(decode_gemm(x3, w, b), x3, w, b)
    assert calls == [(1, 64)]
    _assert_close(decode_gemm(x, w, b, "base"), x, w, b)
    assert calls == [(1, 64)]
    monkeypatch.delenv("DELTASERVE_DECODE_GEMM_KERNEL", raising=False)
    gemm = TritonDecodeGemm()
    assert gemm.kernel == "auto"
    _assert_close(gemm(x, w, b), x, w, b)
    assert calls == [(1, 64), (1, 64)]


def test_gemv_configurations_keep_chunks_in_registers():
    """Every configuration holds at most 64 of W's elements per thread in a chunk (two chunks
    live at once), and the pruning keeps chunks no wider than K's power of two."""
    from deltaserve.ops.linear.triton_gemv import GEMV_CONFIGS, _prune_chunks, gemv_configs

    for bn, ck, warps in GEMV_CONFIGS:
        assert bn * ck // (32 * warps) <= 64, (bn, ck, warps)
    if gemv_configs()[0].kwargs["CHUNK_K"] == 32:  # the interpreter's single configuration
        return
    kept = _prune_chunks(gemv_configs(), {}, K=512)
    assert kept and all(c.kwargs["CHUNK_K"] <= 512 for c in kept)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("N,K", [(2048, 4096), (1281, 2048), (2048, 512), (4096, 12288)])
def test_gemv_gpu_model_shapes(N, K):
    """The tuner's choice and every configuration of its list, bf16, at the thin shapes."""
    from deltaserve.ops.linear.triton_gemv import decode_gemv, gemv_configs

    x, w, b = _inputs(N, K, torch.bfloat16, True, torch.device("cuda"))
    _assert_close(decode_gemv(x, w, b), x, w, b)
    for config in gemv_configs():
        _assert_close(decode_gemv(x, w, b, config), x, w, b)
