"""Backend selection: priority order, reasons for every backend passed over, forced backends."""

import pytest
import torch

from deltaserve.backends import (
    BackendSpec,
    BackendUnavailable,
    Capabilities,
    format_backend_table,
    select,
    select_all,
)
from deltaserve.models.base import AttentionSpec, GDNSpec

CAPS = Capabilities(
    device=torch.device("cpu"),
    dtype=torch.float32,
    state_dtype=torch.float32,
    block_size=16,
    attention=(AttentionSpec(5, 1, 64),),
    gdn=(GDNSpec(2, 4, 16, 24, 4),),
)


def needs_cuda(caps):
    return None if caps.device.type == "cuda" else "no CUDA device"


def no_group_5(caps):
    groups = {s.num_heads // s.num_kv_heads for s in caps.attention}
    return "GQA group 5 unsupported" if 5 in groups else None


REG = {
    "attention": [
        BackendSpec("fast", "attention", "x:Y", needs_cuda),
        BackendSpec("picky", "attention", "x:Y", no_group_5),
        BackendSpec(
            "torch", "attention", "deltaserve.ops.attention.reference:TorchAttentionBackend"
        ),
    ]
}


def test_walks_priority_list_with_reasons():
    d = select("attention", CAPS, registry=REG)
    assert d.chosen.name == "torch"
    assert d.passed_over == (("fast", "no CUDA device"), ("picky", "GQA group 5 unsupported"))
    assert "fast: no CUDA device" in d.describe()


def test_first_able_backend_wins():
    caps = Capabilities(
        torch.device("cpu"), torch.float32, torch.float32, 16, (AttentionSpec(4, 2, 64),)
    )
    d = select("attention", caps, registry=REG)
    assert d.chosen.name == "picky" and d.passed_over == (("fast", "no CUDA device"),)


def test_forced_backend_that_cannot_serve_fails_with_reason():
    with pytest.raises(BackendUnavailable, match="GQA group 5 unsupported"):
        select("attention", CAPS, forced="picky", registry=REG)
    with pytest.raises(BackendUnavailable, match="does not exist"):
        select("attention", CAPS, forced="nope", registry=REG)
    assert select("attention", CAPS, forced="torch", registry=REG).chosen.name == "torch"


def test_default_registry_on_cpu_picks_torch_and_loads_lazily():
    decisions = select_all(CAPS)
    assert set(decisions) == {
        "attention",
        "gdn_prefill",
        "gdn_decode",
        "gdn_replay",
        "conv1d",
        "fused",
        "decode_gemm",
    }
    for d in decisions.values():
        assert d.chosen.name == "torch"
        # every GPU backend passed over says why: no CUDA device here
        assert d.passed_over and all(r == "no CUDA device" for _, r in d.passed_over)
    assert decisions["gdn_decode"].chosen.load().name == "torch"
    assert {n for n, _ in decisions["attention"].passed_over} == {"flashinfer", "triton"}


def _cuda_caps(monkeypatch, installed, *, dtype=torch.bfloat16, attention=(), gdn=(), cc=(9, 0)):
    """Capabilities of a pretend CUDA device with the given packages installed."""
    import deltaserve.backend_checks as backend_checks

    monkeypatch.setattr(backend_checks, "package_installed", lambda name: name in installed)
    monkeypatch.setattr(Capabilities, "compute_capability", property(lambda self: cc))
    return Capabilities(torch.device("cuda"), dtype, torch.float32, 16, attention, gdn)


def test_reasons_on_cuda_without_packages(monkeypatch):
    caps = _cuda_caps(monkeypatch, {"triton"}, attention=(AttentionSpec(16, 4, 256),))
    d = select("attention", caps)
    assert d.chosen.name == "triton"
    assert d.passed_over == (("flashinfer", "flashinfer not installed"),)


def test_flashinfer_chosen_with_tensor_core_note_for_group_5(monkeypatch):
    caps = _cuda_caps(monkeypatch, {"triton", "flashinfer"}, attention=(AttentionSpec(40, 8, 128),))
    d = select("attention", caps)
    assert d.chosen.name == "flashinfer" and d.passed_over == ()
    assert any("GQA group 5 unsupported, using tensor-core path" in n for n in d.notes)
    assert "tensor-core" in d.describe()
    # group 4 needs no note
    caps4 = _cuda_caps(
        monkeypatch, {"triton", "flashinfer"}, attention=(AttentionSpec(16, 4, 256),)
    )
    assert select("attention", caps4).notes == ()


def test_shape_and_dtype_reasons(monkeypatch):
    every = {"triton", "flashinfer", "fla"}
    caps = _cuda_caps(monkeypatch, every, dtype=torch.float32, attention=(AttentionSpec(4, 2, 96),))
    d = select("attention", caps)
    assert d.chosen.name == "torch"
    assert dict(d.passed_over) == {
        "flashinfer": "float32 unsupported (bfloat16 / float16 only)",
        "triton": "head dim 96 unsupported (a power of two in 16..256)",
    }
    caps = _cuda_caps(monkeypatch, {"triton"}, attention=(AttentionSpec(34, 2, 128),))
    assert dict(select("attention", caps).passed_over)["triton"] == (
        "GQA group 17 unsupported (at most 16)"
    )
    with pytest.raises(BackendUnavailable, match="GQA group 17"):
        select("attention", caps, forced="triton")
    old = _cuda_caps(monkeypatch, every, attention=(AttentionSpec(4, 2, 64),), cc=(7, 5))
    assert dict(select("attention", old).passed_over)["triton"] == "compute capability 7.5 < 8.0"
    gdn = _cuda_caps(monkeypatch, every, gdn=(GDNSpec(2, 4, 16, 24, 4),))
    d = select("gdn_decode", gdn)
    assert d.chosen.name == "torch"
    assert "K=16, V=24 unsupported" in dict(d.passed_over)["triton"]
    assert select("gdn_prefill", gdn).chosen.name == "fla"
    assert select("conv1d", gdn).chosen.name == "triton"


def test_gdn_prefill_order_and_reasons(monkeypatch):
    """fla first (its short-row split is internal), then the one-launch triton kernel, then
    torch; triton refuses head dims past 256 and needs CUDA (so `auto` never picks it on CPU)."""
    gdn = (GDNSpec(2, 4, 16, 24, 4),)
    with_fla = _cuda_caps(monkeypatch, {"triton", "fla"}, gdn=gdn)
    assert select("gdn_prefill", with_fla).chosen.name == "fla"
    d = select("gdn_prefill", _cuda_caps(monkeypatch, {"triton"}, gdn=gdn))
    assert d.chosen.name == "triton"
    assert d.passed_over == (("fla", "fla not installed"),)
    wide = _cuda_caps(monkeypatch, {"triton"}, gdn=(GDNSpec(2, 4, 512, 128, 4),))
    d = select("gdn_prefill", wide)
    assert d.chosen.name == "torch"
    assert dict(d.passed_over)["triton"] == "head dims K=512, V=128 unsupported (at most 256)"
    with pytest.raises(BackendUnavailable, match="K=512, V=128 unsupported"):
        select("gdn_prefill", wide, forced="triton")
    assert select("gdn_prefill", CAPS).chosen.name == "torch"
    with pytest.raises(BackendUnavailable, match="no CUDA device"):
        select("gdn_prefill", CAPS, forced="triton")


def test_unknown_op_family_in_forced_is_an_error():
    with pytest.raises(ValueError, match="unknown op families"):
        select_all(CAPS, {"gdn": "torch"})


def test_attention_only_model_selects_no_gdn():
    caps = Capabilities(
        torch.device("cpu"), torch.float32, torch.float32, 16, (AttentionSpec(4, 2, 64),)
    )
    assert set(select_all(caps)) == {"attention", "fused", "decode_gemm"}


def test_backend_table_for_a_checkpoint(tmp_path):
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        layer_types=["linear_attention", "full_attention"],
    )
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    table = format_backend_table(str(tmp_path), device="cpu")
    assert "Qwen3_5ForCausalLM" in table
    lines = table.splitlines()
    assert any(line.startswith("attention") and "torch" in line for line in lines)
    for op in ("gdn_prefill", "gdn_decode", "conv1d"):
        assert any(line.startswith(op) and "no CUDA device" in line for line in lines)
