"""GDN's output norm (`w * norm(o) * silu(z)` per value head) inside the Triton GDN decode
(ops/gdn/triton_decode.py `gdn_decode(norm=...)`, the last of each head's programs applies it;
DELTASERVE_GDN_DECODE_NORM=fused): the decode then the gated-norm kernel's result
(ops/fused/gated_norm.py), the state bit for bit, the arrival counters back at 0; and a GDN
model's decode through it equal to the unfused engine's. CPU: Triton's interpreter at small
sizes; GPU (`pytest -m gpu`): the 9B's heads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel_helpers import kernel_device, lift_backend_check, requires_triton  # noqa: E402


def _inputs(n, hk, hv, dk, dv, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):  # noqa: ANN002, ANN202
        return (scale * torch.randn(*shape, generator=gen)).to(device)

    q, k = r(n, hk, dk).to(dtype), r(n, hk, dk).to(dtype)
    v, a, b = r(n, hv, dv).to(dtype), r(n, hv).to(dtype), r(n, hv).to(dtype)
    A_log = torch.empty(hv).uniform_(0.01, 16, generator=gen).log().to(device)
    dt_bias = r(hv)
    zw = r(n, hv, dv + 3).to(dtype)
    z = zw[..., 1 : 1 + dv]  # [n, hv, dv] a strided view, unit last stride (as in_proj's split)
    norm_w = (1 + r(dv, scale=0.2)).to(dtype)
    pool = r(2 * n + 2, hv, dv, dk, scale=0.5)
    state_slots = (torch.randperm(2 * n + 1, generator=gen)[:n] + 1).to(device)  # shuffled
    return (q, k, v, a, b, A_log, dt_bias), z, norm_w, pool, state_slots


def _check(n, hk, hv, dk, dv, block_v, dtype, device, tol):
    from deltaserve.ops.fused.gated_norm import gated_rms_norm
    from deltaserve.ops.gdn.triton_decode import gdn_decode
    from deltaserve.ops.tile_counters import all_counters

    args, z, norm_w, pool, slots = _inputs(n, hk, hv, dk, dv, dtype, device)
    want_pool = pool.clone()
    got = gdn_decode(*args, pool, slots, block_v=block_v, norm=(z, norm_w, 1e-6))
    o = gdn_decode(*args, want_pool, slots, block_v=block_v)
    want = gated_rms_norm(o, z, norm_w, 1e-6)
    assert torch.equal(pool, want_pool)
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * (want.float().abs().max().item() + 1e-6), err
    assert all(int(c.abs().sum()) == 0 for c in all_counters())


@requires_triton
@pytest.mark.parametrize("n,hk,hv,dk,dv,block_v", [(3, 2, 4, 16, 32, 8), (1, 1, 3, 32, 16, 4)])
def test_decode_with_the_output_norm(n, hk, hv, dk, dv, block_v):
    """Several programs a head (V / BV = 4), GQA, odd head counts: the result of the decode then
    the gated norm, within one rounding of the dtype (the statistics may sum in another
    order); the state identical."""
    dtype = torch.float16 if kernel_device().type == "cpu" else torch.bfloat16
    _check(n, hk, hv, dk, dv, block_v, dtype, kernel_device(), 2e-2)


@requires_triton
def test_output_norm_refuses_what_it_cannot_fuse():
    from deltaserve.ops.gdn.triton_decode import gdn_decode

    dev = kernel_device()
    args, z, norm_w, pool, slots = _inputs(2, 1, 2, 16, 16, torch.float16, dev)
    with pytest.raises(ValueError, match="one token per sequence"):
        gdn_decode(*args, pool, slots[:1], query_len=2, norm=(z, norm_w, 1e-6))
    with pytest.raises(ValueError, match="weight must be"):
        gdn_decode(*args, pool, slots, norm=(z, norm_w[:8], 1e-6))


def test_decode_norm_rule(monkeypatch):
    """Only the Triton decode fuses, only when asked (DELTASERVE_GDN_DECODE_NORM=fused), and
    the layer asks only at all-decode steps of one token per row without a checkpoint."""
    from types import SimpleNamespace

    from deltaserve.ops.gdn import GDNKernels
    from deltaserve.ops.gdn.reference import TorchGDNDecode
    from deltaserve.ops.gdn.triton_decode import TritonGDNDecode

    monkeypatch.delenv("DELTASERVE_GDN_DECODE_NORM", raising=False)
    assert not TritonGDNDecode().fuses_gated_norm() and not TorchGDNDecode().fuses_gated_norm()
    monkeypatch.setenv("DELTASERVE_GDN_DECODE_NORM", "fused")
    assert TritonGDNDecode().fuses_gated_norm() and not TorchGDNDecode().fuses_gated_norm()
    kernels = GDNKernels(None, None, TritonGDNDecode())
    meta = SimpleNamespace(num_prefills=0, decode_query_len=1, checkpoints=[])
    assert kernels.decode_fuses_gated_norm(meta)
    for change in ({"num_prefills": 1}, {"decode_query_len": 3}, {"checkpoints": [(0, 1, 2)]}):
        assert not kernels.decode_fuses_gated_norm(SimpleNamespace(**{**vars(meta), **change}))


def _decode(model_dir, prompts):  # noqa: ANN001, ANN202
    from deltaserve import LLM, SamplingParams

    llm = LLM(
        str(model_dir), device=str(kernel_device()), dtype="float32", max_model_len=128,
        max_num_seqs=2, block_size=16, skip_tokenizer_init=True, seed=0,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[pos[t].logprob for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
           for o in outs]  # fmt: skip
    return toks, lps


@requires_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without a GPU")
def test_gdn_model_decodes_the_same_with_the_norm_in_the_decode(tmp_path, monkeypatch):
    """A tiny Qwen3.5 in float32 with the Triton GDN decode under the interpreter, two
    sequences decoding together: the norm in the decode's launch gives the unfused engine's
    greedy tokens, and logprobs within float32 rounding (the statistics' summation order), and
    the fused path ran."""
    from hf_models import SPECS_BY_NAME, build_model

    from deltaserve.ops.gdn import triton_decode

    lift_backend_check(monkeypatch, "gdn_decode")
    model_dir, _ = build_model(SPECS_BY_NAME["qwen3_5_r2_g3"], tmp_path / "m", load_oracle=False)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 196, (n,), generator=gen).tolist() for n in (5, 8)]
    real, normed = triton_decode.gdn_decode, []

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        if k.get("norm") is not None:
            normed.append(a[0].shape[0])
        return real(*a, **k)

    monkeypatch.setattr(triton_decode, "gdn_decode", counted)
    monkeypatch.setenv("DELTASERVE_GDN_DECODE_NORM", "separate")
    want = _decode(model_dir, prompts)
    assert normed == []
    monkeypatch.setenv("DELTASERVE_GDN_DECODE_NORM", "fused")
    got = _decode(model_dir, prompts)
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=0, atol=1e-5)
    assert normed and max(normed) == 2  # both sequences' decode steps, together


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [1, 16, 64])
def test_gpu_decode_with_the_output_norm_9b_heads(n):
    """bf16 at the 9B's heads (HK 16, HV 32, K = V = 128), the default tiling (16 programs a
    head), batch 1 / 16 / 64."""
    _check(n, 16, 32, 128, 128, None, torch.bfloat16, "cuda", 1e-2)


def _decode_sig() -> dict:
    sig = {p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr")}
    sig.update(A_log_ptr="*fp32", dt_bias_ptr="*fp32", state_ptr="*fp32", slots_ptr="*i64")
    sig["out_ptr"] = "*bf16"
    for n, last in (("q", "k"), ("k", "k"), ("v", "v")):
        sig.update({f"stride_{n}n": "i32", f"stride_{n}h": "i32", f"stride_{n}{last}": "i32"})
    sig.update(stride_an="i32", stride_ah="i32", stride_bn="i32", stride_bh="i32")
    sig.update({f"stride_s{c}": "i32" for c in "nhvk"})
    sig.update(stride_on="i32", stride_oh="i32", stride_ov="i32", scale="fp32")
    sig.update(z_ptr="*bf16", stride_zn="i32", stride_zh="i32", nw_ptr="*bf16")
    sig.update(cnt_ptr="*i32", eps="fp32")
    for c in ("HV", "GROUP", "K", "V", "BK", "BV", "QLEN", "QLEN_PAD", "NORM", "VP", "PDL"):
        sig[c] = "constexpr"
    return sig


def test_decode_compiles_for_sm90_with_and_without_the_norm():
    """The 9B's decode (HV 32, GROUP 2, K = V = 128, BV 8, 2 warps, PDL) for sm_90: no spills
    either way; with the norm the arrival counter's atomics, without it none."""
    from sm90_compile import compile_many, ptxas_path

    if ptxas_path() is None:
        pytest.skip("this Triton has no NVIDIA backend (ptxas)")
    sig = _decode_sig()
    jobs = []
    for norm in (False, True):
        consts = dict(HV=32, GROUP=2, K=128, V=128, BK=128, BV=8, QLEN=1, QLEN_PAD=1,
                      NORM=norm, VP=128, PDL=True)  # fmt: skip
        jobs.append(dict(
            kernel="deltaserve.ops.gdn.triton_decode:_gdn_decode_kernel", signature=sig,
            constexprs=consts, div16=["q_ptr", "k_ptr", "v_ptr", "state_ptr", "out_ptr"],
            num_warps=2, num_stages=1,
        ))  # fmt: skip
    plain, normed = compile_many(jobs)
    for res in (plain, normed):
        assert "error" not in res, res
        assert res["spill_bytes"] == 0, res
    assert not plain["has_atomics"] and normed["has_atomics"]
