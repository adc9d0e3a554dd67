"""The weight-loading seams, on toy models: per-expert checkpoint tensors stacked into one
[E, ...] parameter (fused shards, tensor-parallel slices, strict accounting by checkpoint
name), and a projection de-interleaved by `process_weights_after_loading` (after loading and
after random init)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from deltaserve.distributed.sharding import ShardRule
from deltaserve.layers import weight_loading
from deltaserve.loader.random_model import init_random_weights
from deltaserve.loader.weights import WeightLoadError, load_weights
from deltaserve.models.base import CausalLM, WeightRule

E, HIDDEN, INTER = 3, 8, 6


class ToyExperts(nn.Module):
    """Experts stacked over E: gate_up [E, 2 * INTER, HIDDEN] (shards gate_proj | up_proj) in
    one module, down [E, HIDDEN, INTER] in another (`stacked_experts`)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Module()
        self.gate_up.stacked_experts = E
        self.gate_up.shard_offsets = {"gate_proj": (0, INTER), "up_proj": (INTER, INTER)}
        self.gate_up.weight = nn.Parameter(torch.zeros(E, 2 * INTER, HIDDEN))
        self.down = nn.Module()
        self.down.stacked_experts = E
        self.down.weight = nn.Parameter(torch.zeros(E, HIDDEN, INTER))


class ToyMoE(CausalLM):
    """`model.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight` + a norm, with Qwen3's packed
    modules (gate_proj / up_proj) declared too: the expert rules must win over them."""

    packed_modules = {"gate_proj": ("gate_up_proj", "gate_proj")}
    weight_rules = (
        WeightRule("experts.{e}.gate_proj.weight", "experts.gate_up.weight", "gate_proj"),
        WeightRule("experts.{e}.up_proj.weight", "experts.gate_up.weight", "up_proj"),
        WeightRule("experts.{e}.down_proj.weight", "experts.down.weight"),
    )

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.experts = ToyExperts()
        layer.norm = nn.Module()
        layer.norm.weight = nn.Parameter(torch.zeros(HIDDEN))
        self.model.layers = nn.ModuleList([layer])


def _expert_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"model.layers.0.norm.weight": torch.randn(HIDDEN, generator=g)}
    for e in range(E):
        prefix = f"model.layers.0.mlp.experts.{e}."
        out[prefix + "gate_proj.weight"] = torch.randn(INTER, HIDDEN, generator=g)
        out[prefix + "up_proj.weight"] = torch.randn(INTER, HIDDEN, generator=g)
        out[prefix + "down_proj.weight"] = torch.randn(HIDDEN, INTER, generator=g)
    return out


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_experts_stacked_into_one_parameter(tmp_path):
    tensors = _expert_tensors()
    model = ToyMoE()
    load_weights(model, _save(tmp_path, tensors))
    experts = model.model.layers[0].mlp.experts
    p = "model.layers.0.mlp.experts."
    want_gate_up = torch.stack(
        [
            torch.cat([tensors[f"{p}{e}.gate_proj.weight"], tensors[f"{p}{e}.up_proj.weight"]])
            for e in range(E)
        ]
    )  # [E, 2 * INTER, HIDDEN]
    want_down = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(E)])
    assert torch.equal(experts.gate_up.weight, want_gate_up)
    assert torch.equal(experts.down.weight, want_down)
    assert torch.equal(model.model.layers[0].norm.weight, tensors["model.layers.0.norm.weight"])


def test_missing_expert_is_named_with_its_shape(tmp_path):
    tensors = _expert_tensors()
    del tensors["model.layers.0.mlp.experts.1.up_proj.weight"]
    del tensors["model.layers.0.mlp.experts.2.down_proj.weight"]
    with pytest.raises(WeightLoadError, match="missing tensor") as excinfo:
        load_weights(ToyMoE(), _save(tmp_path, tensors))
    msg = str(excinfo.value)
    assert f"model.layers.0.mlp.experts.1.up_proj.weight [{INTER}, {HIDDEN}]" in msg
    assert f"model.layers.0.mlp.experts.2.down_proj.weight [{HIDDEN}, {INTER}]" in msg
    assert "experts.0." not in msg and "gate_proj" not in msg


def test_misshaped_duplicate_and_out_of_range_experts(tmp_path):
    bad = _expert_tensors()
    bad["model.layers.0.mlp.experts.2.gate_proj.weight"] = torch.zeros(INTER, HIDDEN + 1)
    with pytest.raises(WeightLoadError) as excinfo:
        load_weights(ToyMoE(), _save(tmp_path / "shape", bad))
    msg = str(excinfo.value)
    assert "model.layers.0.mlp.experts.2.gate_proj.weight" in msg
    assert f"[{INTER}, {HIDDEN + 1}]" in msg and f"[{INTER}, {HIDDEN}]" in msg

    extra = _expert_tensors()
    extra[f"model.layers.0.mlp.experts.{E}.down_proj.weight"] = torch.zeros(HIDDEN, INTER)
    with pytest.raises(WeightLoadError, match=re.escape(f"mlp.experts.{E}.down_proj.weight")):
        load_weights(ToyMoE(), _save(tmp_path / "extra", extra))

    path = _save(tmp_path / "dup", _expert_tensors())
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    save_file({name: torch.zeros(HIDDEN, INTER)}, str(path / "more.safetensors"))
    with pytest.raises(WeightLoadError, match=re.escape(f"{name} appears twice")):
        load_weights(ToyMoE(), path)


def test_expert_shard_takes_its_tensor_parallel_slice(monkeypatch):
    """Rank 1 of 2 with the intermediate size split: each expert's gate and up rows are cut to
    the rank's half (the checkpoint's full shape is still what is checked)."""
    monkeypatch.setattr(weight_loading, "tp_size", lambda: 2)
    monkeypatch.setattr(weight_loading, "tp_rank", lambda: 1)
    half = INTER // 2
    mod = nn.Module()
    mod.stacked_experts = E
    mod.shard_offsets = {"gate_proj": (0, half), "up_proj": (half, half)}
    mod.tp_rules = {("weight", s): ShardRule(0, (INTER,)) for s in ("gate_proj", "up_proj")}
    mod.weight = nn.Parameter(torch.zeros(E, 2 * half, HIDDEN), requires_grad=False)
    assert weight_loading.weight_slots(mod, "weight") == [
        (s, e) for e in range(E) for s in ("gate_proj", "up_proj")
    ]
    assert weight_loading.weight_shape(mod, "weight", "up_proj", 2) == (INTER, HIDDEN)
    up = torch.randn(INTER, HIDDEN)
    weight_loading.load_weight(mod, "weight", up, "up_proj", 2)
    assert torch.equal(mod.weight[2, half:], up[half:])
    assert not mod.weight[2, :half].any() and not mod.weight[:2].any()


class InterleavedProj(nn.Module):
    """A projection whose checkpoint rows interleave two outputs per group
    ([a_0 | b_0 | a_1 | b_1 | ...], as Qwen3-Next's in_proj_qkvz groups by key head); the hook
    de-interleaves them once, to [a_0 | a_1 | ... | b_0 | b_1 | ...], so forward can split."""

    def __init__(self, groups: int, width: int, hidden: int) -> None:
        super().__init__()
        self.groups, self.width = groups, width
        self.weight = nn.Parameter(torch.zeros(2 * groups * width, hidden), requires_grad=False)
        self.hook_calls = 0

    def process_weights_after_loading(self) -> None:
        self.hook_calls += 1
        w = self.weight.data  # [G * 2 * W, hidden]
        w = w.view(self.groups, 2, self.width, -1).transpose(0, 1)  # [2, G, W, hidden]
        self.weight.data = w.reshape(2 * self.groups * self.width, -1).contiguous()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = (x @ self.weight.T).chunk(2, dim=-1)
        return a, b


class ToyInterleaved(CausalLM):
    def __init__(self) -> None:
        super().__init__()
        self.proj = InterleavedProj(groups=3, width=2, hidden=5)


def test_projection_deinterleaved_after_loading(tmp_path):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 2, 5, generator=g)  # [G, W, hidden]
    b = torch.randn(3, 2, 5, generator=g)
    interleaved = torch.stack([a, b], dim=1).reshape(12, 5)  # rows [a_0 | b_0 | a_1 | ...]
    model = ToyInterleaved()
    load_weights(model, _save(tmp_path, {"proj.weight": interleaved}))
    assert model.proj.hook_calls == 1
    assert torch.equal(model.proj.weight, torch.cat([a.reshape(6, 5), b.reshape(6, 5)]))
    x = torch.randn(4, 5, generator=g)
    got_a, got_b = model.proj(x)
    torch.testing.assert_close(got_a, x @ a.reshape(6, 5).T)
    torch.testing.assert_close(got_b, x @ b.reshape(6, 5).T)


def test_hooks_run_after_random_init_children_first():
    order: list[str] = []

    class Leaf(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name
            self.weight = nn.Parameter(torch.zeros(2, 2), requires_grad=False)

        def process_weights_after_loading(self) -> None:
            assert self.weight.abs().sum() > 0, "hook ran before the weights were filled"
            order.append(self.name)

    class Parent(Leaf):
        def __init__(self) -> None:
            super().__init__("parent")
            self.child = Leaf("child")

    model = nn.Module()
    model.a = Parent()
    model.b = Leaf("b")
    init_random_weights(model, seed=0)
    assert order.index("child") < order.index("parent")
    assert sorted(order) == ["b", "child", "parent"]
