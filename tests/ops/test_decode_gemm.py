"""The decode GEMM (ops/linear): Triton kernel against the float32 torch reference (CPU:
Triton's interpreter at small sizes; GPU: `pytest -m gpu`, the 9B model's shapes), the layers'
routing (decode-sized inputs to the chosen GEMM, prefills to F.linear) and the selector's
reasons."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_helpers import kernel_device, requires_triton  # noqa: E402

from deltaserve.backend_checks import check_triton_decode_gemm  # noqa: E402
from deltaserve.backends import Capabilities  # noqa: E402
from deltaserve.layers.parallel_linear import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
)
from deltaserve.ops.linear import MAX_ROWS, attach_decode_gemm  # noqa: E402


def _reference(x, w, b):
    y = x.float() @ w.float().T
    return y if b is None else y + b.float()


def _check(M, N, K, dtype, bias, strided, device, kernel="splitk"):
    gen = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    from deltaserve.ops.linear.triton_gemm import decode_gemm

    x_full = torch.randn(M, K + (7 if strided else 0), generator=gen).to(dtype)
    x = x_full[:, 3 : 3 + K] if strided else x_full  # a column slice: row stride K + 7
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    x, w = x.to(device), w.to(device)
    b = b.to(device) if b is not None else None
    got = decode_gemm(x, w, b, kernel)
    assert got.shape == (M, N) and got.dtype == dtype
    want = _reference(x, w, b)
    err = (got.float() - want).abs().max().item()
    scale = want.abs().max().item() + 1e-6
    assert err <= 1e-2 * scale, f"M={M} N={N} K={K}: max error {err} vs scale {scale}"


@requires_triton
@pytest.mark.parametrize("M,N,K", [(1, 37, 64), (3, 100, 130), (16, 33, 5), (7, 1, 48)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", ["splitk", "base"])
def test_decode_gemm_matches_reference_small(M, N, K, bias, kernel):
    dtype = torch.float16 if kernel_device().type == "cpu" else torch.bfloat16
    _check(M, N, K, dtype, bias, strided=(M == 3), device=kernel_device(), kernel=kernel)


@requires_triton
def test_decode_gemm_rejects_bad_shapes():
    from deltaserve.ops.linear.triton_gemm import decode_gemm

    dev = kernel_device()
    w = torch.zeros(8, 16, dtype=torch.float16, device=dev)
    with pytest.raises(ValueError, match="features"):
        decode_gemm(torch.zeros(1, 15, dtype=torch.float16, device=dev), w)
    for kernel in ("auto", "base"):  # the split-K kernel's wide tiles, the base kernel's
        with pytest.raises(ValueError, match="at most 64 rows"):
            decode_gemm(torch.zeros(65, 16, dtype=torch.float16, device=dev), w, kernel=kernel)


@requires_triton
@pytest.mark.parametrize("M,N,K", [(17, 37, 64), (33, 100, 130), (64, 20, 48)])
@pytest.mark.parametrize("kernel", ["base", "auto"])
def test_decode_gemm_wide_rows_match_reference(M, N, K, kernel):
    """17-64 rows: the base kernel's wide tiles (x padded to 32 or 64 rows) and the split-K
    kernel's ("auto") against the float32 product."""
    dtype = torch.float16 if kernel_device().type == "cpu" else torch.bfloat16
    _check(M, N, K, dtype, bias=(M == 33), strided=(M == 17), device=kernel_device(), kernel=kernel)


def test_wide_base_configurations_fit_and_are_kept_apart():
    """The tuner's wide list leaves out tiles whose pipelined loads exceed the shared memory it
    allows at 64 rows, and its pruning hook hands each row count its own list."""
    from deltaserve.ops.linear import triton_gemm as tg

    wide = tg.wide_base_configs(64)
    assert wide and all(tg._is_wide(c) for c in wide)
    for c in wide:
        bn, bk = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        assert (c.num_stages - 1) * (bn + 64) * bk * 2 <= tg.WIDE_SMEM_BYTES
    narrow = tg.base_configs()
    assert not any(tg._is_wide(c) for c in narrow)
    both = narrow + wide
    assert tg._prune_by_rows(both, {}, BLOCK_M=16) == narrow
    assert tg._prune_by_rows(both, {}, BLOCK_M=64) == wide
    # Triton's on-disk tuning cache rebuilds each Config from its attributes: nothing extra
    import triton

    for c in both:
        assert str(triton.Config(**c.__dict__)) == str(c)


@requires_triton
@pytest.mark.parametrize("M,N,K", [(1, 37, 64), (16, 100, 130)])
def test_decode_gemm_base_with_a_given_configuration(M, N, K):
    """`decode_gemm_base(..., config)` (the benchmark's sweep) launches that configuration
    instead of the tuner's and still computes x @ W.T: on CPU two tile shapes other than the
    interpreter's one tuned configuration; on a GPU every configuration of the tuner."""
    import triton

    from deltaserve.ops.linear.triton_gemm import base_configs, decode_gemm_base

    device = kernel_device()
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(N)
    x = torch.randn(M, K, generator=gen).to(dtype).to(device)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype).to(device)
    want = _reference(x, w, None)
    if device.type == "cpu":
        configs = [
            triton.Config({"BLOCK_N": 32, "BLOCK_K": 64}, num_warps=4, num_stages=1),
            triton.Config({"BLOCK_N": 16, "BLOCK_K": 128}, num_warps=2, num_stages=1),
        ]
    else:
        configs = base_configs()
    for config in configs:
        got = decode_gemm_base(x, w, None, config)
        err = (got.float() - want).abs().max().item()
        assert err <= 1e-2 * (want.abs().max().item() + 1e-6), f"{config}: max error {err}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 5, 16, 40, 64])
@pytest.mark.parametrize("N,K", [(12352, 4096), (4096, 12288), (1000, 72)])
@pytest.mark.parametrize("kernel", ["splitk", "base"])
def test_decode_gemm_gpu_model_shapes(M, N, K, kernel):
    _check(
        M, N, K, torch.bfloat16, bias=(N == 1000), strided=(M == 5), device="cuda", kernel=kernel
    )


def test_layers_route_decode_rows_to_the_gemm():
    calls = []

    def fake_gemm(x, w, b):
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, w, b)

    model = torch.nn.Sequential(
        ColumnParallelLinear(8, {"a": 4, "b": 6}, bias=True), RowParallelLinear(10, 8)
    )
    assert attach_decode_gemm(model, fake_gemm) == 2
    x = torch.randn(MAX_ROWS, 8)
    want = model[1](model[0](x))  # through the fake GEMM
    assert calls == [MAX_ROWS, MAX_ROWS]
    calls.clear()
    model(torch.randn(MAX_ROWS + 1, 8))  # a prefill: F.linear
    assert calls == []
    attach_decode_gemm(model, None)
    torch.testing.assert_close(model[1](model[0](x)), want)
    assert calls == []


def test_selector_reasons_for_triton_decode_gemm(monkeypatch):
    import deltaserve.backend_checks as backend_checks

    cpu = Capabilities(torch.device("cpu"), torch.bfloat16, torch.float32, 16)
    assert check_triton_decode_gemm(cpu) == "no CUDA device"
    monkeypatch.setattr(backend_checks, "package_installed", lambda name: True)
    monkeypatch.setattr(Capabilities, "compute_capability", property(lambda self: (9, 0)))
    cuda32 = Capabilities(torch.device("cuda"), torch.float32, torch.float32, 16)
    assert check_triton_decode_gemm(cuda32) == "float32 unsupported (bfloat16 / float16 only)"
    cuda16 = Capabilities(torch.device("cuda"), torch.bfloat16, torch.float32, 16)
    assert check_triton_decode_gemm(cuda16) is None
