"""GDN's conv1d update in the one-row GEMV's epilogue (ops/linear/triton_gemv.py and
triton_gemv_norm.py with a `ConvEpilogue`; DELTASERVE_GDN_CONV_GEMV=fused): the same output
bits and conv state as the GEMV then the conv decode kernel (ops/gdn/triton_conv1d.py), close to
the torch reference (`ops.linear.conv_linear`), only the row's slot touched; and a GDN model's
batch-1 decode through it equal to the unfused engine. CPU: Triton's interpreter at small
sizes; GPU (`pytest -m gpu`): the 9B's and 35B-A3B's in_proj shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_helpers import kernel_device, lift_backend_check, requires_triton  # noqa: E402

from deltaserve.ops.linear import ConvEpilogue, NormedInput, conv_linear  # noqa: E402


def _case(n, c, k, width, dtype, device, bias, slots=4, seed=0):
    """x [1, k], W [n, k] (the first c output columns are conv channels), a conv weight and a
    pool of `slots` random windows; the row's slot is 2."""
    gen = torch.Generator().manual_seed(seed + 7 * n + k)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    cw = (0.5 * torch.randn(c, width, generator=gen)).to(dtype)
    state = torch.randn(slots, c, width - 1, generator=gen).to(dtype)
    slot = torch.tensor([2], dtype=torch.int64)
    x, w, cw, state, slot = (t.to(device) for t in (x, w, cw, state, slot))
    return x, w, (b.to(device) if b is not None else None), cw, state, slot


def _separate(project, cw, state, slot):
    """The projection, then the conv decode kernel on its first columns (the unfused path)."""
    from deltaserve.ops.gdn.triton_conv1d import conv1d_decode

    y = project()
    c = cw.shape[0]
    y[:, :c] = conv1d_decode(y[:, :c], cw, state, slot)
    return y


@requires_triton
@pytest.mark.parametrize("n,c,k", [(52, 40, 100), (24, 24, 64), (37, 20, 33)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [4, 3])
def test_gemv_conv_equals_gemv_then_conv(n, c, k, bias, width):
    """Conv channels in every program's columns or in some (a tile straddling C), all of N,
    bias or not, widths 4 and 3: the output and the state bit for bit the unfused path's,
    other slots untouched, and within rounding of the torch reference."""
    from deltaserve.ops.linear.triton_gemv import decode_gemv

    dtype = torch.float16 if kernel_device().type == "cpu" else torch.bfloat16
    x, w, b, cw, state, slot = _case(n, c, k, width, dtype, kernel_device(), bias)
    s_sep, s_ref = state.clone(), state.clone()
    got = decode_gemv(x, w, b, conv=ConvEpilogue(cw, state, slot))
    want = _separate(lambda: decode_gemv(x, w, b), cw, s_sep, slot)
    assert torch.equal(got, want)
    assert torch.equal(state, s_sep)
    assert torch.equal(state[[0, 1, 3]], s_ref[[0, 1, 3]])  # only the row's slot moved
    assert not torch.equal(state[2], s_ref[2])
    ref = conv_linear(x, w, b, ConvEpilogue(cw, s_ref, slot))
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(state.float(), s_ref.float(), rtol=1e-2, atol=1e-2)


@requires_triton
@pytest.mark.parametrize("n,c,k", [(52, 40, 100), (37, 20, 33)])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_gemv_norm_conv_equals_gemv_norm_then_conv(n, c, k, zero_centered):
    """The GEMV with the residual add + norm (the 35B-A3B's in_proj path) and the epilogue:
    the output, the new stream and the state as the unfused pair's, bit for bit."""
    from deltaserve.ops.linear.triton_gemv_norm import decode_gemv_add_norm

    dtype = torch.float16 if kernel_device().type == "cpu" else torch.bfloat16
    h, w, _, cw, state, slot = _case(n, c, k, 4, dtype, kernel_device(), False)
    gen = torch.Generator().manual_seed(3)
    res = torch.randn(1, k, generator=gen).to(dtype).to(h.device)
    nw = 0.2 * torch.randn(k, generator=gen)
    nw = (nw if zero_centered else 1 + nw).to(torch.float32 if zero_centered else dtype)
    nw = nw.to(h.device)
    s_sep, s_ref = state.clone(), state.clone()

    def run(res_out, conv=None):  # noqa: ANN001, ANN202
        return decode_gemv_add_norm(
            h, res, nw, 1e-6, zero_centered, w, residual_out=res_out, conv=conv
        )

    r_got, r_want = torch.empty_like(h), torch.empty_like(h)
    got = run(r_got, ConvEpilogue(cw, state, slot))
    want = _separate(lambda: run(r_want), cw, s_sep, slot)
    assert torch.equal(got, want) and torch.equal(r_got, r_want) and torch.equal(state, s_sep)
    ref_in = NormedInput(h, res, nw, 1e-6, zero_centered, torch.empty_like(h))
    ref = conv_linear(ref_in, w, None, ConvEpilogue(cw, s_ref, slot))
    torch.testing.assert_close(got.float(), ref.float(), rtol=3e-2, atol=3e-2)


def test_conv_epilogue_refuses_a_mismatched_pool():
    from deltaserve.ops.linear.triton_gemv import conv_launch_args

    cw = torch.zeros(8, 4)
    with pytest.raises(ValueError, match=r"does not match a \[slots, 8, 3\] pool"):
        conv_launch_args(ConvEpilogue(cw, torch.zeros(2, 8, 4), torch.zeros(1).long()), cw)
    with pytest.raises(ValueError, match="int64"):
        conv_launch_args(ConvEpilogue(cw, torch.zeros(2, 8, 3), torch.zeros(1).int()), cw)


def test_conv_gemv_rule(monkeypatch):
    """One-row steps under kernel auto with DELTASERVE_GDN_CONV_GEMV=fused (off by default);
    the torch backend never."""
    from deltaserve.ops.linear import TorchDecodeGemm
    from deltaserve.ops.linear.triton_gemm import TritonDecodeGemm

    monkeypatch.delenv("DELTASERVE_GDN_CONV_GEMV", raising=False)
    assert not TritonDecodeGemm().fuses_conv(1)
    monkeypatch.setenv("DELTASERVE_GDN_CONV_GEMV", "fused")
    assert TritonDecodeGemm().fuses_conv(1)
    assert not TritonDecodeGemm().fuses_conv(2)
    assert not TritonDecodeGemm(kernel="base").fuses_conv(1)
    assert not TorchDecodeGemm().fuses_conv(1)
    monkeypatch.setenv("DELTASERVE_GDN_CONV_GEMV", "sometimes")
    with pytest.raises(ValueError, match="DELTASERVE_GDN_CONV_GEMV must be"):
        TritonDecodeGemm()


def _greedy(model_dir, prompts, **kw):  # noqa: ANN001, ANN003, ANN202
    from deltaserve import LLM, SamplingParams

    llm = LLM(
        str(model_dir), device=str(kernel_device()), dtype="float32", max_model_len=128,
        max_num_seqs=1, block_size=16, skip_tokenizer_init=True, seed=0,
        decode_gemm_backend="triton", **kw,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
    toks, lps = [], []
    for p in prompts:  # one at a time: batch-1 decode steps
        (out,) = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        c = out.outputs[0]
        toks.append(list(c.token_ids))
        lps.append([pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs, strict=True)])
    return toks, lps


@requires_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
def test_gdn_model_decodes_the_same_with_the_conv_in_the_gemv(tmp_path, monkeypatch):
    """A tiny Qwen3.5 (GDN and attention layers) in float32 with the Triton decode GEMM and
    conv under the interpreter: batch-1 greedy decode with the conv in the in_proj's GEMV gives
    the unfused engine's tokens and logprobs bit for bit, and the fused launch ran (one-row
    steps only)."""
    from hf_models import SPECS_BY_NAME, build_model

    from deltaserve.ops.linear import triton_gemv

    lift_backend_check(monkeypatch, "decode_gemm")
    lift_backend_check(monkeypatch, "conv1d")  # the unfused path's conv: the same math
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_5_r2_g3"], tmp_path / "m", load_oracle=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 196, (n,), generator=gen).tolist() for n in (6, 9)]
    real, conv_calls = triton_gemv.decode_gemv, []

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        if k.get("conv") is not None:
            conv_calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(triton_gemv, "decode_gemv", counted)
    monkeypatch.setenv("DELTASERVE_GDN_CONV_GEMV", "separate")
    want = _greedy(model_dir, prompts)
    assert conv_calls == []
    monkeypatch.setenv("DELTASERVE_GDN_CONV_GEMV", "fused")
    got = _greedy(model_dir, prompts)
    assert got == want
    assert len(conv_calls) > 0 and all(s == (1, s[1]) for s in conv_calls)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "n,c,k,normed",
    [(12352, 8192, 4096, False), (8512, 8192, 2048, True)],  # 9B; 35B-A3B (with the norm)
    ids=["9b", "35b-a3b"],
)
def test_gpu_conv_epilogue_model_shapes(n, c, k, normed):
    """bf16 at the models' in_proj shapes (conv dim 8192, width 4, 64 slots): bit for bit the
    unfused pair, tuned configuration included."""
    from deltaserve.ops.linear.triton_gemv import decode_gemv
    from deltaserve.ops.linear.triton_gemv_norm import decode_gemv_add_norm

    x, w, _, cw, state, slot = _case(n, c, k, 4, torch.bfloat16, "cuda", False, slots=64)
    s_sep = state.clone()
    if normed:
        res = torch.randn_like(x)
        nw = 0.1 * torch.randn(k, device="cuda")
        r1, r2 = torch.empty_like(x), torch.empty_like(x)
        got = decode_gemv_add_norm(
            x, res, nw, 1e-6, True, w, residual_out=r1, conv=ConvEpilogue(cw, state, slot)
        )
        want = _separate(
            lambda: decode_gemv_add_norm(x, res, nw, 1e-6, True, w, residual_out=r2),
            cw, s_sep, slot,
        )  # fmt: skip
        assert torch.equal(r1, r2)
    else:
        got = decode_gemv(x, w, conv=ConvEpilogue(cw, state, slot))
        want = _separate(lambda: decode_gemv(x, w), cw, s_sep, slot)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(state, s_sep)
