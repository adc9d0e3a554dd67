"""The expanded MLA prefill (deltaserve/ops/mla/expanded.py: keys and values rebuilt from the
latents, PyTorch attention) equals the absorbed torch reference followed by W_UV, in float32,
on paged latents in shuffled blocks: sequences with and without cached context, one token, and
odd head / width sizes (the engine's HF parity with it: tests/models/test_deepseek_v2_parity.py)."""

from __future__ import annotations

import pytest
import torch
from mla_cases import make_mla_case, reference

from deltaserve.ops.mla.expanded import expanded_prefill
from deltaserve.ops.mla.reference import write_latent


@pytest.mark.parametrize(
    "seqs,heads,r,p,n,v,page",
    [
        ([(0, 7), (30, 5), (13, 1)], 3, 20, 6, 10, 12, 8),  # nope != v, context and none
        ([(17, 9)], 1, 24, 8, 16, 16, 16),
        ([(5, 3), (0, 16)], 16, 32, 16, 8, 24, 4),
        ([(6, 4), (0, 5)], 2, 16, 4, 4, 20, 4),  # v wider than nope + rope: q and k padded
    ],
)
def test_expanded_equals_absorbed_reference(seqs, heads, r, p, n, v, page) -> None:
    case = make_mla_case(seqs, 0, heads, r, p, page, torch.float32, seed=heads + r)
    write_latent(case.c_kv, case.k_pe, case.cache, case.meta.slot_mapping)
    gen = torch.Generator().manual_seed(5)
    dev = case.q_lat.device
    w_uk = torch.randn(heads, n, r, generator=gen).to(dev) / r**0.5  # [H, N, R]
    w_uv = torch.randn(heads, r, v, generator=gen).to(dev) / r**0.5  # [H, R, V]
    q_nope = torch.randn(case.q_lat.shape[0], heads, n, generator=gen).to(dev)
    case.q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # the absorbed query
    scale = 0.3
    want = torch.einsum("thr,hrv->thv", reference(case, scale), w_uv)  # [T, H, V]
    m = case.meta
    got = expanded_prefill(
        q_nope, case.q_pe, case.cache, m.query_start_loc_cpu, m.seq_lens_cpu, m.block_tables,
        w_uk, w_uv, scale,
    )  # fmt: skip
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("seqs", [[(0, 300)], [(200, 77), (0, 64)]])
def test_expanded_runs_pytorchs_fused_attention_on_the_gpu(seqs) -> None:
    """V2-Lite's head sizes (N 128, P 64, V 128, R 512, 16 heads) in bf16 with PyTorch's
    attention restricted to its fused kernels (flash, memory-efficient: an error if neither
    can serve), with and without cached context, against the float32 absorbed reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, r, p, n, v = 16, 512, 64, 128, 128
    dev = torch.device("cuda")
    case = make_mla_case(seqs, 0, heads, r, p, 16, torch.bfloat16, seed=3, device=dev)
    write_latent(case.c_kv, case.k_pe, case.cache, case.meta.slot_mapping)
    gen = torch.Generator(device=dev).manual_seed(7)
    w_uk = (torch.randn(heads, n, r, generator=gen, device=dev) / r**0.5).bfloat16()
    w_uv = (torch.randn(heads, r, v, generator=gen, device=dev) / r**0.5).bfloat16()
    q_nope = torch.randn(case.q_lat.shape[0], heads, n, generator=gen, device=dev).bfloat16()
    case.q_lat = torch.einsum("thn,hnr->thr", q_nope.float(), w_uk.float())
    case.q_pe, case.cache = case.q_pe.float(), case.cache.float()
    want = torch.einsum("thr,hrv->thv", reference(case, 0.1), w_uv.float())
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        m = case.meta
        got = expanded_prefill(
            q_nope, case.q_pe.bfloat16(), case.cache.bfloat16(), m.query_start_loc_cpu,
            m.seq_lens_cpu, m.block_tables, w_uk, w_uv, 0.1,
        )  # fmt: skip
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.02)


def test_prefill_mode_env(monkeypatch) -> None:
    from deltaserve import env

    monkeypatch.delenv("DELTASERVE_MLA_PREFILL", raising=False)
    assert env.mla_prefill() == "auto"
    monkeypatch.setenv("DELTASERVE_MLA_PREFILL", " Expanded ")
    assert env.mla_prefill() == "expanded"
    monkeypatch.setenv("DELTASERVE_MLA_PREFILL", "absorbed")
    assert env.mla_prefill() == "absorbed"
    monkeypatch.setenv("DELTASERVE_MLA_PREFILL", "latent")
    with pytest.raises(ValueError, match="must be auto, absorbed or expanded, got 'latent'"):
        env.mla_prefill()
