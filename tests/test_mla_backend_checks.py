"""The mla op family's selection: split (FlashInfer's prefill, our decode) where both halves
serve at <= 32 heads per rank, then triton, then flashinfer, then torch, each passed over with
its reason; above 32 heads triton steps aside for flashinfer whenever that can serve, saying why
(pretend CUDA devices and installed packages, so this runs on CPU)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.backends import BackendUnavailable, Capabilities, select
from deltaserve.cache.spec import MLASpec

V2 = MLASpec(num_heads=16, kv_lora_rank=512, rope_dim=64)


def cuda_caps(monkeypatch, installed, *, dtype=torch.bfloat16, spec=V2, cc=(9, 0), device="cuda"):
    import deltaserve.backend_checks as backend_checks

    monkeypatch.setattr(backend_checks, "package_installed", lambda name: name in installed)
    monkeypatch.setattr(Capabilities, "compute_capability", property(lambda self: cc))
    return Capabilities(torch.device(device), dtype, torch.float32, 16, mla=(spec,))


def test_priority_split_then_triton_then_flashinfer_then_torch(monkeypatch):
    """V2-Lite's 16 heads: split where FlashInfer and Triton both serve, triton where
    FlashInfer cannot (float32 here), flashinfer without Triton; each forced choice serves."""
    every = {"triton", "flashinfer"}
    d = select("mla", cuda_caps(monkeypatch, every))
    assert d.chosen.name == "split" and d.passed_over == ()
    for name in ("triton", "flashinfer"):
        assert select("mla", cuda_caps(monkeypatch, every), name).chosen.name == name
    fp32 = cuda_caps(monkeypatch, every, dtype=torch.float32)
    d = select("mla", fp32)
    assert d.chosen.name == "triton"
    assert d.passed_over == (("split", "float32 unsupported (bfloat16 / float16 only)"),)
    d = select("mla", cuda_caps(monkeypatch, {"flashinfer"}))
    assert d.chosen.name == "flashinfer"
    assert d.passed_over == (
        ("split", "triton not installed"),
        ("triton", "triton not installed"),
    )


def test_many_heads_prefer_flashinfer_when_it_can_serve(monkeypatch):
    """DeepSeek-V2's 128 heads: the decode is compute-bound and FlashInfer's kernel measured 3x
    ours, so triton is passed over with that reason; without FlashInfer triton serves."""
    v2 = MLASpec(num_heads=128, kv_lora_rank=512, rope_dim=64)
    d = select("mla", cuda_caps(monkeypatch, {"triton", "flashinfer"}, spec=v2))
    assert d.chosen.name == "flashinfer"
    assert [name for name, _ in d.passed_over] == ["split", "triton"]
    assert "use flashinfer" in d.passed_over[0][1]
    assert "128 query heads per rank" in d.passed_over[1][1]
    forced = select("mla", cuda_caps(monkeypatch, {"triton", "flashinfer"}, spec=v2), "triton")
    assert forced.chosen.name == "triton"  # a preference, not an inability: forcing still works
    assert select("mla", cuda_caps(monkeypatch, {"triton"}, spec=v2)).chosen.name == "triton"
    fp32 = cuda_caps(monkeypatch, {"triton", "flashinfer"}, spec=v2, dtype=torch.float32)
    assert select("mla", fp32).chosen.name == "triton"  # flashinfer cannot serve float32


def test_cpu_takes_torch_with_reasons(monkeypatch):
    caps = cuda_caps(monkeypatch, {"triton", "flashinfer"}, device="cpu")
    d = select("mla", caps)
    assert d.chosen.name == "torch"
    assert dict(d.passed_over) == {
        "flashinfer": "no CUDA device",
        "triton": "no CUDA device",
        "split": "no CUDA device",
    }
    with pytest.raises(BackendUnavailable, match="no CUDA device"):
        select("mla", caps, forced="triton")


def test_shape_dtype_and_device_reasons(monkeypatch):
    every = {"triton", "flashinfer"}
    fp32 = cuda_caps(monkeypatch, every, dtype=torch.float32)
    assert select("mla", fp32).chosen.name == "triton"
    with pytest.raises(BackendUnavailable, match=r"float32 unsupported \(bfloat16 / float16"):
        select("mla", fp32, forced="flashinfer")
    small = MLASpec(num_heads=3, kv_lora_rank=20, rope_dim=6)
    d = select("mla", cuda_caps(monkeypatch, {"flashinfer"}, spec=small))
    assert d.chosen.name == "torch"
    assert dict(d.passed_over)["flashinfer"] == (
        "kv_lora_rank 20 / rope dim 6 unsupported (512 / 64 only)"
    )
    wide = MLASpec(num_heads=16, kv_lora_rank=1024, rope_dim=64)
    d = select("mla", cuda_caps(monkeypatch, every, spec=wide))
    assert d.chosen.name == "torch"
    assert dict(d.passed_over)["triton"] == "kv_lora_rank 1024 unsupported (at most 512)"
    rope = MLASpec(num_heads=16, kv_lora_rank=512, rope_dim=256)
    assert dict(select("mla", cuda_caps(monkeypatch, {"triton"}, spec=rope)).passed_over)[
        "triton"
    ] == ("rope dim 256 unsupported (at most 128)")
    old = cuda_caps(monkeypatch, every, cc=(7, 5))
    assert dict(select("mla", old).passed_over) == {
        "flashinfer": "compute capability 7.5 < 8.0",
        "triton": "compute capability 7.5 < 8.0",
        "split": "compute capability 7.5 < 8.0",
    }


def test_split_serves_where_both_halves_can(monkeypatch):
    """`split` (FlashInfer prefill, Triton decode), auto or forced, needs both halves and at
    most TRITON_MLA_DECODE_MAX_HEADS heads per rank, else it names what is missing."""
    every = {"triton", "flashinfer"}
    assert select("mla", cuda_caps(monkeypatch, every)).chosen.name == "split"
    assert select("mla", cuda_caps(monkeypatch, every), "split").chosen.name == "split"
    with pytest.raises(BackendUnavailable, match="triton not installed"):
        select("mla", cuda_caps(monkeypatch, {"flashinfer"}), "split")
    with pytest.raises(BackendUnavailable, match="flashinfer not installed"):
        select("mla", cuda_caps(monkeypatch, {"triton"}), "split")
    fp32 = cuda_caps(monkeypatch, every, dtype=torch.float32)
    with pytest.raises(BackendUnavailable, match=r"float32 unsupported \(bfloat16 / float16"):
        select("mla", fp32, "split")
    v2 = MLASpec(num_heads=128, kv_lora_rank=512, rope_dim=64)
    with pytest.raises(BackendUnavailable, match="128 query heads per rank.*use flashinfer"):
        select("mla", cuda_caps(monkeypatch, every, spec=v2), "split")


def test_triton_mla_backend_declares_graph_support():
    pytest.importorskip("triton")
    from deltaserve.ops.mla.triton_backend import TritonMLABackend

    assert TritonMLABackend.supports_cuda_graph is True
    assert 1 in TritonMLABackend.graph_query_lens and 4 in TritonMLABackend.graph_query_lens


@pytest.mark.parametrize("mode", ["", "absorbed", "expanded"])
def test_triton_notes_say_how_prefill_rows_attend(monkeypatch, mode):
    """The triton decision's notes (`deltaserve backends`) state DELTASERVE_MLA_PREFILL's
    policy: by default the 4096-token threshold of the expanded form, else the forced mode."""
    pytest.importorskip("triton")
    monkeypatch.setenv("DELTASERVE_MLA_PREFILL", mode)
    d = select("mla", cuda_caps(monkeypatch, {"triton"}))
    assert d.chosen.name == "triton"
    if mode:
        assert d.notes == (f"prefill rows: {mode} (DELTASERVE_MLA_PREFILL)",)
    else:
        assert len(d.notes) == 1 and ">= 4096 tokens: expanded" in d.notes[0]
        assert "expanded" in d.describe()


@pytest.mark.parametrize("mode", ["", "expanded"])
def test_split_notes_say_how_prefill_rows_attend(monkeypatch, mode):
    """The split decision's notes state its own threshold (6144 tokens: FlashInfer's prefill
    below it, measured) by default, else the forced mode."""
    pytest.importorskip("triton")
    monkeypatch.setenv("DELTASERVE_MLA_PREFILL", mode)
    d = select("mla", cuda_caps(monkeypatch, {"triton", "flashinfer"}))
    assert d.chosen.name == "split"
    if mode:
        assert d.notes == (f"prefill rows: {mode} (DELTASERVE_MLA_PREFILL)",)
    else:
        assert len(d.notes) == 1 and ">= 6144 tokens: expanded" in d.notes[0]
