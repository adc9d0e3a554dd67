"""The float32 router logits (DeepSeek-V2's router) of the `moe` backends: the Triton kernel
(ops/moe/triton_router.py; Triton's interpreter on CPU, `pytest -m gpu` at V2-Lite's sizes)
against torch's F.linear(x.float(), W), which HF computes; the backends' `router_logits`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_helpers import kernel_device, requires_triton  # noqa: E402

from deltaserve.ops.moe import router_logits_torch  # noqa: E402
from deltaserve.ops.moe.reference import TorchMoE  # noqa: E402

pytestmark = requires_triton


def _inputs(tokens: int, experts: int, hidden: int, dtype: torch.dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden + 3, generator=gen) * 2).to(dtype)[:, :hidden]  # row stride
    w = torch.randn(experts, hidden, generator=gen) / hidden**0.5
    return x.to(device), w.to(device)


@pytest.mark.parametrize("tokens", [0, 1, 3, 16, 17, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_router_logits_match_torch(tokens, dtype):
    from deltaserve.ops.moe.triton_router import router_logits_triton

    x, w = _inputs(tokens, 10, 200, dtype, kernel_device(), seed=tokens)
    got = router_logits_triton(x, w)
    want = router_logits_torch(x.cpu(), w.cpu())
    assert got.dtype == torch.float32 and got.shape == (tokens, 10)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_triton_router_rejects_a_bad_weight():
    from deltaserve.ops.moe.triton_router import router_logits_triton

    x, w = _inputs(2, 4, 32, torch.float32, kernel_device())
    with pytest.raises(ValueError, match="float32"):
        router_logits_triton(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="H=32"):
        router_logits_triton(x, w[:, :16])


def test_backends_router_logits(monkeypatch):
    """The torch backend is F.linear; the Triton backend runs its kernel up to
    ROUTER_TRITON_MAX_ROWS tokens and F.linear above (both equal torch's logits)."""
    from deltaserve.ops.moe import triton_backend
    from deltaserve.ops.moe.triton_backend import TritonMoE

    x, w = _inputs(5, 6, 48, torch.float32, "cpu")
    assert torch.equal(TorchMoE().router_logits(x, w), router_logits_torch(x, w))
    calls = []
    real = triton_backend.router_logits_triton
    monkeypatch.setattr(
        triton_backend, "router_logits_triton", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    monkeypatch.setattr(triton_backend, "ROUTER_TRITON_MAX_ROWS", 4)
    dev = kernel_device()
    for tokens in (4, 5):
        xs, ws = x[:tokens].to(dev), w.to(dev)
        got = TritonMoE().router_logits(xs, ws)
        torch.testing.assert_close(got.cpu(), router_logits_torch(x[:tokens], w))
    assert calls == [4]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_gpu_router_logits_v2_lite_sizes(tokens):
    """V2-Lite's router (64 experts, hidden 2048), bf16 activations, on the GPU."""
    from deltaserve.ops.moe.triton_router import router_logits_triton

    x, w = _inputs(tokens, 64, 2048, torch.bfloat16, "cuda", seed=tokens)
    got = router_logits_triton(x, w)
    want = router_logits_torch(x.double(), w.double()).float()  # exact products, then rounded
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
