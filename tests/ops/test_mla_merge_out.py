"""The split MLA decode's merge joined to the W_UV product (ops/mla/triton_merge_out.py, on with
DELTASERVE_MLA_MERGE=fused): `mla_decode(..., w_uv=W)` gives the separate path's merge then
per-head matmul within float32 rounding, for 1 to 4 rows (more take the separate path), with
empty splits, a sequence of no latents and CUDA-graph padding rows (zeros); the Triton backend's
`forward_out` equals `forward` then `head_matmul` for all-decode and mixed steps (CPU:
Triton's interpreter; GPU: `pytest -m gpu` at V2's widths)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import kernel_device, requires_triton
from meta_helpers import rel_err
from mla_cases import make_mla_case

from deltaserve.ops.mla.reference import write_latent

pytestmark = requires_triton


def _w_uv(heads: int, r: int, v: int, dtype, device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, r, v, generator=gen) / r**0.5).to(dtype).to(device)


@pytest.mark.parametrize("seqs", [[(18, 1)], [(0, 1), (40, 1)], [(5, 1), (9, 1), (30, 1), (2, 1)]])
@pytest.mark.parametrize("splits", [3, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merged_w_uv_equals_merge_then_matmul(monkeypatch, seqs, splits, dtype):
    from deltaserve.ops.mla import triton_decode

    monkeypatch.setattr(triton_decode, "POISON_SCRATCH", True)
    heads, r, p, v = 3, 24, 8, 20
    case = make_mla_case(seqs, len(seqs), heads, r, p, 8, dtype, seed=len(seqs) + splits)
    write_latent(case.c_kv, case.k_pe, case.cache, case.meta.slot_mapping)
    w_uv = _w_uv(heads, r, v, dtype, kernel_device())
    # one CUDA-graph padding row past the batch
    q_lat = torch.cat([case.q_lat, torch.randn_like(case.q_lat[:1])])
    q_pe = torch.cat([case.q_pe, torch.randn_like(case.q_pe[:1])])
    seq_lens = case.meta.seq_lens.clone()
    if len(seqs) == 2:
        seq_lens[0] = 0  # a padded batch row: no latents, zeros out
    args = (q_lat, q_pe, case.cache, seq_lens, case.meta.block_tables, 0.3)
    cfg = {"NUM_SPLITS": splits}
    monkeypatch.setenv("DELTASERVE_MLA_MERGE", "separate")
    want = triton_decode.mla_decode(*args, config=cfg, w_uv=w_uv)
    monkeypatch.setenv("DELTASERVE_MLA_MERGE", "fused")
    calls = []
    real = triton_decode.merge_w_uv
    monkeypatch.setattr(triton_decode, "merge_w_uv", lambda *a: calls.append(1) or real(*a))
    got = triton_decode.mla_decode(*args, config=cfg, w_uv=w_uv)
    assert calls == [1]
    assert got.shape == (len(seqs) + 1, heads, v) and got.dtype == dtype
    assert torch.isfinite(got).all() and torch.count_nonzero(got[-1]) == 0
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(got, want) < tol
    if len(seqs) == 2:
        assert torch.count_nonzero(got[0]) == 0


def test_more_rows_take_the_separate_path(monkeypatch):
    from deltaserve.ops.mla import triton_decode
    from deltaserve.ops.mla.triton_merge_out import MAX_ROWS

    monkeypatch.setenv("DELTASERVE_MLA_MERGE", "fused")
    seqs = [(3 + i, 1) for i in range(MAX_ROWS + 1)]
    case = make_mla_case(seqs, len(seqs), 2, 16, 8, 8, torch.float32)
    write_latent(case.c_kv, case.k_pe, case.cache, case.meta.slot_mapping)
    calls = []
    monkeypatch.setattr(triton_decode, "merge_w_uv", lambda *a: calls.append(1))
    w_uv = _w_uv(2, 16, 8, torch.float32, kernel_device())
    out = triton_decode.mla_decode(
        case.q_lat, case.q_pe, case.cache, case.meta.seq_lens, case.meta.block_tables, 0.3,
        config={"NUM_SPLITS": 2}, w_uv=w_uv,
    )  # fmt: skip
    assert calls == [] and out.shape == (MAX_ROWS + 1, 2, 8)


@pytest.mark.parametrize("merge", ["fused", "separate"])
@pytest.mark.parametrize("seqs, num_decodes", [([(11, 1), (30, 1)], 2), ([(4, 1), (9, 6)], 1)])
def test_backend_forward_out(monkeypatch, merge, seqs, num_decodes):
    """forward_out = forward then head_matmul (all-decode steps through the split decode's
    W_UV argument, a mixed step through forward), latents written the same."""
    from deltaserve.ops.mla.triton_backend import TritonMLABackend

    monkeypatch.setenv("DELTASERVE_MLA_MERGE", merge)
    case = make_mla_case(seqs, num_decodes, 3, 20, 6, 8, torch.float32, seed=7)
    w_uv = _w_uv(3, 20, 12, torch.float32, kernel_device())
    backend = TritonMLABackend()
    cache = case.cache.clone()
    call = (case.q_lat, case.q_pe, case.c_kv, case.k_pe)
    want = backend.head_matmul(backend.forward(*call, cache, case.meta, 0.4), w_uv)
    got = backend.forward_out(*call, case.cache, case.meta, 0.4, w_uv)
    torch.testing.assert_close(case.cache, cache, rtol=0, atol=0, equal_nan=True)
    assert rel_err(got, want) < 1e-5


def test_bad_merge_choice(monkeypatch):
    from deltaserve import env

    monkeypatch.setenv("DELTASERVE_MLA_MERGE", "maybe")
    with pytest.raises(ValueError, match="DELTASERVE_MLA_MERGE must be"):
        env.mla_merge()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("batch", [1, 4])
def test_gpu_merged_w_uv_real_widths(monkeypatch, heads, batch):
    """bf16 at V2's widths (R 512, P 64, V 128), the decode's own split count, tuned."""
    from deltaserve.ops.mla import triton_decode

    seqs = [(300 + 97 * i, 1) for i in range(batch)]
    case = make_mla_case(seqs, batch, heads, 512, 64, 64, torch.bfloat16, device="cuda")
    write_latent(case.c_kv, case.k_pe, case.cache, case.meta.slot_mapping)
    w_uv = _w_uv(heads, 512, 128, torch.bfloat16, "cuda")
    args = (case.q_lat, case.q_pe, case.cache, case.meta.seq_lens, case.meta.block_tables, 0.1)
    monkeypatch.setenv("DELTASERVE_MLA_MERGE", "separate")
    want = triton_decode.mla_decode(*args, w_uv=w_uv)
    monkeypatch.setenv("DELTASERVE_MLA_MERGE", "fused")
    got = triton_decode.mla_decode(*args, w_uv=w_uv)
    assert rel_err(got, want) < 1e-2
