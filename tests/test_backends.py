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
    assert set(decisions) == {"attention", "gdn"}
    for d in decisions.values():
        assert d.chosen.name == "torch"
    assert decisions["gdn"].chosen.load().name == "torch"


def test_attention_only_model_selects_no_gdn():
    caps = Capabilities(
        torch.device("cpu"), torch.float32, torch.float32, 16, (AttentionSpec(4, 2, 64),)
    )
    assert set(select_all(caps)) == {"attention"}


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
    assert any(line.startswith("gdn") and "torch" in line for line in lines)
