"""The MLA layer's per-head matmul for decode-sized steps (ops/mla/triton_head_matmul.py)
against float32 torch.bmm: strided x (q_nope is a column slice of q), K and N not powers of
two, 1 to 64 rows (x padded to 16, 32, 64), 16-bit and float32 (CPU: Triton's interpreter; GPU:
`pytest -m gpu` at DeepSeek-V2-Lite's and V2's widths). The CUDA MLA backends use it up to 64
rows and torch.bmm above; the base backend and a context without one use torch.bmm."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton


def _want(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("thk,hkn->thn", x.float(), w.float())


def _inputs(T, H, K, N, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed + T * 100 + K)
    q = torch.randn(T, H, K + 9, generator=gen)  # x = q[..., :K]: strides (H (K + 9), K + 9, 1)
    w = torch.randn(H, K, N, generator=gen) / K**0.5
    return q.to(dtype).to(device)[..., :K], w.to(dtype).to(device)


def _close(got, want, dtype):
    assert got.is_contiguous()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    err = (got.float() - want).abs().max().item()
    assert err <= tol * (want.abs().max().item() + 1e-6), f"max error {err}"


@requires_triton
@pytest.mark.parametrize("T", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_head_matmul_matches_bmm(T, dtype):
    from deltaserve.ops.mla.triton_head_matmul import head_matmul

    x, w = _inputs(T, 3, 24, 40, dtype, kernel_device())
    got = head_matmul(x, w)
    assert got.shape == (T, 3, 40) and got.dtype == dtype
    _close(got, _want(x, w), dtype)


@requires_triton
@pytest.mark.parametrize("T", [1, 64])
def test_head_matmul_float32_in_k_steps(T):
    """float32 runs K in steps of 64: K 200 takes four, the last one partial."""
    from deltaserve.ops.mla.triton_head_matmul import head_matmul

    x, w = _inputs(T, 2, 200, 24, torch.float32, kernel_device())
    _close(head_matmul(x, w), _want(x, w), torch.float32)


@requires_triton
def test_head_matmul_rejects_bad_input():
    from deltaserve.ops.mla.triton_head_matmul import head_matmul

    x, w = _inputs(65, 2, 16, 16, torch.float16, kernel_device())
    with pytest.raises(ValueError, match="at most 64 rows, got 65"):
        head_matmul(x, w)
    with pytest.raises(ValueError, match="does not match"):
        head_matmul(x[:4], w[:, :8])


@requires_triton
def test_backends_route_by_rows(monkeypatch):
    """The mixin: up to 64 rows through the kernel, more through torch.bmm (same answer); the
    base MLABackend (the torch reference) always torch.bmm."""
    from deltaserve.ops.mla import triton_head_matmul
    from deltaserve.ops.mla.reference import TorchMLABackend
    from deltaserve.ops.mla.triton_backend import TritonMLABackend

    calls = []
    real = triton_head_matmul.head_matmul
    monkeypatch.setattr(
        triton_head_matmul, "head_matmul", lambda x, w: calls.append(x.shape[0]) or real(x, w)
    )
    backend = TritonMLABackend()
    for T in (2, 70):
        x, w = _inputs(T, 2, 16, 24, torch.float32, kernel_device())
        _close(backend.head_matmul(x, w), _want(x, w), torch.float32)
        _close(TorchMLABackend().head_matmul(x, w), _want(x, w), torch.float32)
    assert calls == [2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 16, 64])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("K,N", [(128, 512), (512, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_matmul_gpu_model_widths(T, H, K, N, dtype):
    from deltaserve.ops.mla.triton_head_matmul import head_matmul

    x, w = _inputs(T, H, K, N, dtype, torch.device("cuda"))
    _close(head_matmul(x, w), _want(x, w), dtype)


def _prep_inputs(T, H, N, R, P, dtype, device, seed=0):
    """q [T, H, N + P] (q_nope, q_pe: strided column slices of it), kv_a [T, R + P] (a column
    slice of a wider row), kv_a_layernorm's weight, cos / sin [T, P / 2] float32, W_UK [H, N,
    R]."""
    gen = torch.Generator().manual_seed(seed + T)
    q = torch.randn(T, H, N + P, generator=gen).to(dtype).to(device)
    wide = torch.randn(T, R + P + 7, generator=gen).to(dtype).to(device)
    angles = torch.rand(T, P // 2, generator=gen) * 6.0
    weight = (torch.rand(R, generator=gen) + 0.5).to(dtype).to(device)
    w_uk = (torch.randn(H, N, R, generator=gen) / N**0.5).to(dtype).to(device)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    return q[..., :N], q[..., N:], wide[:, 3 : R + P + 3], weight, cos, sin, w_uk


@requires_triton
@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("H, N, R, P", [(3, 24, 40, 8), (16, 32, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prep_in_one_launch_equals_the_two(T, H, N, R, P, dtype):
    """rope_norm_head_matmul (one grid: the per-head matmul's programs, then one rope / norm
    program per token) gives the bits of mla_rope_norm and head_matmul run apart."""
    from deltaserve.ops.fused.mla_prep import mla_rope_norm
    from deltaserve.ops.mla.triton_head_matmul import head_matmul, rope_norm_head_matmul

    q_nope, q_pe, kv_a, weight, cos, sin, w_uk = _prep_inputs(T, H, N, R, P, dtype, kernel_device())
    want_q, want_lat = mla_rope_norm(q_pe, kv_a, weight, cos, sin, 1e-6)
    want_lat_q = head_matmul(q_nope, w_uk)
    got_q, got_lat, got_lat_q = rope_norm_head_matmul(
        q_nope, q_pe, kv_a, weight, cos, sin, 1e-6, w_uk
    )
    assert torch.equal(got_q, want_q) and torch.equal(got_lat, want_lat)
    assert torch.equal(got_lat_q, want_lat_q)


@requires_triton
def test_backend_prep_fused_or_separate(monkeypatch):
    """The CUDA backends' `prep`: one launch up to 64 rows (DELTASERVE_MLA_PREP=fused, the
    default), the two launches with `separate` and above 64 rows; the same results as the base
    backend's (the torch reference's) math, and a bad choice refused."""
    from deltaserve import env
    from deltaserve.ops.fused import reference as fused_reference
    from deltaserve.ops.mla import triton_head_matmul
    from deltaserve.ops.mla.reference import TorchMLABackend
    from deltaserve.ops.mla.triton_backend import TritonMLABackend

    class Fused:  # the FusedOps the layer passes: the torch reference's rope / norm
        mla_rope_norm = staticmethod(fused_reference.mla_rope_norm)

    calls = []
    real = triton_head_matmul.rope_norm_head_matmul
    monkeypatch.setattr(
        triton_head_matmul,
        "rope_norm_head_matmul",
        lambda *a: calls.append(a[0].shape[0]) or real(*a),
    )
    for choice, T, fused_calls in (("fused", 2, [2]), ("separate", 2, []), ("fused", 70, [])):
        monkeypatch.setenv("DELTASERVE_MLA_PREP", choice)
        calls.clear()
        args = _prep_inputs(T, 2, 16, 32, 8, torch.float32, kernel_device())
        got = TritonMLABackend().prep(Fused, *args[:5], args[5], 1e-6, args[6])
        want = TorchMLABackend().prep(Fused, *args[:5], args[5], 1e-6, args[6])
        assert calls == fused_calls
        for g, w in zip(got, want):
            _close(g.contiguous(), w.float(), torch.float32)
    monkeypatch.setenv("DELTASERVE_MLA_PREP", "both")
    with pytest.raises(ValueError, match="DELTASERVE_MLA_PREP must be"):
        env.mla_prep()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1, 16, 64])
@pytest.mark.parametrize("H", [16, 128])
def test_prep_gpu_model_widths(T, H):
    """bf16 at DeepSeek-V2's widths (nope 128, R 512, rope 64), tuned: the bits of the two
    launches."""
    from deltaserve.ops.fused.mla_prep import mla_rope_norm
    from deltaserve.ops.mla.triton_head_matmul import head_matmul, rope_norm_head_matmul

    args = _prep_inputs(T, H, 128, 512, 64, torch.bfloat16, torch.device("cuda"))
    q_nope, q_pe, kv_a, weight, cos, sin, w_uk = args
    want = (*mla_rope_norm(q_pe, kv_a, weight, cos, sin, 1e-6), head_matmul(q_nope, w_uk))
    got = rope_norm_head_matmul(q_nope, q_pe, kv_a, weight, cos, sin, 1e-6, w_uk)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
