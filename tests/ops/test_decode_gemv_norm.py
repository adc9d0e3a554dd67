"""The one-row GEMV with the residual add and RMSNorm in its launch (ops/linear/
triton_gemv_norm.py) against the torch reference (`ops.linear.add_norm_linear`: the fused ops'
torch rms_norm then F.linear), and the decoder layers' use of it (layers/decoder.py
`normed_input`): the same outputs and stream as the norm kernel then the projection. CPU:
Triton's interpreter at small sizes; GPU (`pytest -m gpu`): the 9B's and 35B-A3B's shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_helpers import kernel_device, requires_triton  # noqa: E402

from deltaserve.ops.linear import NormedInput, add_norm_linear  # noqa: E402


def _case(n, k, dtype, zero_centered, bias, device, seed=0, normed=True):
    gen = torch.Generator().manual_seed(seed + 31 * n + k)
    h = torch.randn(1, k, generator=gen).to(dtype)
    res = (3 * torch.randn(1, k, generator=gen)).to(dtype)
    nw = torch.randn(k, generator=gen) * 0.2
    nw = nw if zero_centered else (1 + nw).to(dtype)  # float32 weight when zero-centred
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    h, res, nw, w = (t.to(device) for t in (h, res, nw, w))
    b = b.to(device) if b is not None else None

    def normed_input() -> NormedInput:
        return NormedInput(
            h, res, nw, 1e-6, zero_centered, torch.empty_like(h),
            torch.empty_like(h) if normed else None,
        )  # fmt: skip

    return normed_input, w, b


def _check(got, got_in: NormedInput, want, want_in: NormedInput):
    torch.testing.assert_close(got_in.residual_out, want_in.residual_out, rtol=0, atol=0)
    if want_in.normed_out is not None:
        # the statistics sum chunk by chunk: rstd may differ in its last bit
        torch.testing.assert_close(got_in.normed_out, want_in.normed_out, rtol=1e-2, atol=1e-2)
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() + 1e-6
    assert got.shape == want.shape and got.dtype == want.dtype
    assert err <= 1e-2 * scale, f"max error {err} against scale {scale}"


@requires_triton
@pytest.mark.parametrize("n,k", [(37, 64), (5, 100), (33, 200), (9, 31)])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_add_norm_matches_reference(n, k, zero_centered, bias):
    """Odd N, K of one partial chunk and of several (the statistics loop and the prefetch
    chain); both norm forms; h and residual left as they were."""
    from deltaserve.ops.linear.triton_gemv_norm import decode_gemv_add_norm

    dtype = torch.float16 if kernel_device().type == "cpu" else torch.bfloat16
    make, w, b = _case(n, k, dtype, zero_centered, bias, kernel_device(), normed=bias)
    x = make()
    h0, r0 = x.h.clone(), x.residual.clone()
    got = decode_gemv_add_norm(
        x.h, x.residual, x.norm_weight, x.eps, x.zero_centered, w, b,
        residual_out=x.residual_out, normed_out=x.normed_out,
    )  # fmt: skip
    assert torch.equal(x.h, h0) and torch.equal(x.residual, r0)
    ref = make()
    _check(got, x, add_norm_linear(ref, w, b), ref)


@requires_triton
def test_gemv_add_norm_rejects_bad_buffers():
    from deltaserve.ops.linear.triton_gemv_norm import decode_gemv_add_norm

    make, w, _ = _case(8, 32, torch.float16, False, False, kernel_device())
    x = make()
    with pytest.raises(ValueError, match="needs residual_out"):
        decode_gemv_add_norm(x.h, x.residual, x.norm_weight, 1e-6, False, w)
    with pytest.raises(ValueError, match="residual_out must be a contiguous"):
        decode_gemv_add_norm(
            x.h, x.residual, x.norm_weight, 1e-6, False, w, residual_out=x.h.float()
        )
    with pytest.raises(ValueError, match=r"contiguous \[32\] vector"):
        decode_gemv_add_norm(
            x.h, x.residual, x.norm_weight[:16], 1e-6, False, w, residual_out=x.residual_out
        )


@requires_triton
@pytest.mark.parametrize("block", ["mlp", "moe"])
def test_decoder_layer_hands_its_norm_to_the_first_projection(monkeypatch, block):
    """`DecoderLayer.ffn_output` at one row with the Triton decode GEMM: the MLP's gate_up (and
    the MoE block's in_proj, whose experts read the normalised row again) form the input; the
    output and the new stream equal the norm kernel's path (DELTASERVE_NORM_GEMV=separate)."""
    from deltaserve.layers.decoder import normed_input
    from deltaserve.layers.mlp import GatedMLP
    from deltaserve.layers.norms import RMSNorm
    from deltaserve.ops.linear.triton_gemm import TritonDecodeGemm

    dtype = torch.float16 if kernel_device().type == "cpu" else torch.bfloat16
    dev = kernel_device()
    k = 48
    gen = torch.Generator().manual_seed(5)
    if block == "mlp":
        mod = GatedMLP(k, 40)
    else:  # a stand-in for SparseMoeBlock: in_proj forms the input, the rest reads it again
        mod = _RereadingBlock(k)
    for p in mod.parameters():
        p.data = (torch.randn(p.shape, generator=gen) / k**0.5).to(dtype)
    mod = mod.to(dev)
    norm = RMSNorm(k, 1e-6, zero_centered=True)
    norm.weight.data = (0.1 * torch.randn(k, generator=gen)).to(dev)
    h = torch.randn(1, k, generator=gen).to(dtype).to(dev)
    res = torch.randn(1, k, generator=gen).to(dtype).to(dev)

    monkeypatch.setenv("DELTASERVE_NORM_GEMV", "fused")
    gemm = TritonDecodeGemm()
    for m in mod.modules():
        if hasattr(m, "decode_gemm"):
            m.decode_gemm = gemm
    fused = normed_input(mod, h, res, norm)
    assert fused is not None and isinstance(fused[0], NormedInput)
    assert (fused[0].normed_out is not None) == (block == "moe")
    assert normed_input(mod, torch.cat([h, h]), torch.cat([res, res]), norm) is None  # 2 rows
    got = mod.forward_plain(fused[0]) if block == "moe" else _mlp(mod, fused[0])

    from deltaserve.ops.fused.reference import rms_norm

    stream = res.clone()
    y, _ = rms_norm(h, norm.weight, 1e-6, True, residual=stream)
    want = mod.forward_plain(y) if block == "moe" else _mlp(mod, y)
    torch.testing.assert_close(fused[1], stream, rtol=0, atol=0)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 2e-2 * (want.float().abs().max().item() + 1e-6), err

    monkeypatch.setenv("DELTASERVE_NORM_GEMV", "separate")
    gemm_off = TritonDecodeGemm()
    for m in mod.modules():
        if hasattr(m, "decode_gemm"):
            m.decode_gemm = gemm_off
    assert normed_input(mod, h, res, norm) is None


def test_norm_gemv_rule(monkeypatch):
    """One row of hidden size up to NORM_GEMV_MAX_K under kernel auto, unless turned off; the
    torch backend never."""
    from deltaserve.ops.linear import TorchDecodeGemm
    from deltaserve.ops.linear.triton_gemm import NORM_GEMV_MAX_K, TritonDecodeGemm

    monkeypatch.delenv("DELTASERVE_NORM_GEMV", raising=False)
    monkeypatch.delenv("DELTASERVE_DECODE_GEMM_KERNEL", raising=False)
    gemm = TritonDecodeGemm()
    assert gemm.fuses_add_norm(1, NORM_GEMV_MAX_K)
    assert not gemm.fuses_add_norm(1, 2 * NORM_GEMV_MAX_K)  # the 9B's 4096: measured slower
    assert not gemm.fuses_add_norm(2, 64)
    assert not TritonDecodeGemm(kernel="base").fuses_add_norm(1, 64)
    assert not TorchDecodeGemm().fuses_add_norm(1, 64)
    monkeypatch.setenv("DELTASERVE_NORM_GEMV", "separate")
    assert not TritonDecodeGemm().fuses_add_norm(1, 64)


def _mlp(mod, x):
    import torch.nn.functional as F

    g, u = mod.gate_up_proj(x).chunk(2, dim=-1)
    return F.linear(F.silu(g.float()).to(g.dtype) * u, mod.down_proj.weight)


class _RereadingBlock(torch.nn.Module):
    """in_proj forms the input; the output also reads the normalised row (as the MoE experts
    do)."""

    normed_input_projection = "in_proj"
    rereads_input = True

    def __init__(self, k: int) -> None:
        super().__init__()
        from deltaserve.layers.parallel_linear import ColumnParallelLinear

        self.in_proj = ColumnParallelLinear(k, {"in_proj": 24})

    def forward_plain(self, x):
        y = self.in_proj(x)
        if isinstance(x, NormedInput):
            x = x.normed_out
        return torch.cat([y, x], dim=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", [(12352, 4096), (10240, 4096), (24576, 4096), (12352, 2048),
                                 (1281, 2048), (3648, 2048)])  # fmt: skip
@pytest.mark.parametrize("zero_centered", [False, True])
def test_gemv_add_norm_gpu_model_shapes(n, k, zero_centered):
    """The tuner's choice and every configuration of its list, bf16, at the models' shapes."""
    from deltaserve.ops.linear.triton_gemv import gemv_configs
    from deltaserve.ops.linear.triton_gemv_norm import decode_gemv_add_norm

    make, w, b = _case(n, k, torch.bfloat16, zero_centered, False, torch.device("cuda"))
    ref = make()
    want = add_norm_linear(ref, w, b)
    for config in (None, *gemv_configs()):
        x = make()
        got = decode_gemv_add_norm(
            x.h, x.residual, x.norm_weight, x.eps, x.zero_centered, w, b,
            residual_out=x.residual_out, normed_out=x.normed_out, config=config,
        )  # fmt: skip
        _check(got, x, want, ref)
