"""Tensor parallelism of MoE layers on CPU over gloo: Qwen3.5-MoE and Qwen3-Next at TP=2 give
TP=1's greedy tokens and logprobs, in both checkpoint layouts (per-expert and fused experts).

Under TP each rank holds every expert's slice of the intermediate dimension (w13: its gate rows
and its up rows; w2: the same columns); the shared expert is split like a dense MLP and the
block all-reduces once. The slicing is checked directly (rank by rank, both layouts) and end to
end; an expert width TP does not divide fails at start-up, naming the config field.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import re

import pytest
import torch
from hf_models import SPECS_BY_NAME, build_model
from test_tensor_parallel import _assert_close, _make_llm, _prompts, _run, _worker_processes

from deltaserve.distributed import parallel_state
from deltaserve.distributed.parallel_state import tp_size
from deltaserve.layers.moe import MoEExperts
from deltaserve.layers.weight_loading import load_weight, weight_shape


@pytest.mark.parametrize(
    "spec_name",
    [
        "qwen3_5_moe_e10k3_g3",  # per-expert tensors, 10 experts top-3, GQA group 3
        "qwen3_5_moe_e12k4_g5_fused",  # fused experts, 12 experts top-4, GQA group 5
        "qwen3_next_e12k4_r3_step2_nonorm",  # per-expert, dense layers 0 and 2, GDN ratio 3
        "qwen3_next_e10k4_r2_mlponly_fused",  # fused, mlp_only_layers, K > V
    ],
)
def test_moe_tp2_matches_tp1(tmp_path, spec_name: str) -> None:
    spec = SPECS_BY_NAME[spec_name]
    model_dir, _ = build_model(spec, tmp_path / spec_name, load_oracle=False)
    prompts = _prompts(spec.config["vocab_size"])

    ref_llm = _make_llm(model_dir, 1)
    ref, ref_plp = _run(ref_llm, prompts)
    del ref_llm

    llm = _make_llm(model_dir, 2)
    assert tp_size() == 2
    procs = _worker_processes(llm)
    try:
        moe = next(m for m in llm.llm_engine.runner.model.modules() if hasattr(m, "op_spec"))
        inter = spec.config["moe_intermediate_size"]
        assert moe.experts.w13.shape[1:] == (inter, spec.config["hidden_size"])  # 2 * I / 2
        assert moe.experts.w2.shape[-1] == inter // 2
        assert not moe.reduce_results  # its sum is left to the norm after it
        ours, plp = _run(llm, prompts)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    assert all(not p.is_alive() and p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert tp_size() == 1

    for i, (a, b) in enumerate(zip(ours, ref)):
        assert list(a.token_ids) == list(b.token_ids), (spec_name, i)
        _assert_close(a.logprobs, b.logprobs, f"{spec_name}: logprobs of prompt {i}")
    _assert_close(plp, ref_plp, f"{spec_name}: prompt logprobs")


@pytest.fixture
def fake_tp(monkeypatch):
    """Pretend to be rank `r` of `size` (no process group: layers and loaders read the state)."""

    def set_rank(rank: int, size: int) -> None:
        monkeypatch.setitem(parallel_state._STATE, "rank", rank)
        monkeypatch.setitem(parallel_state._STATE, "size", size)

    return set_rank


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_slices_per_rank_both_layouts(fake_tp, tp: int) -> None:
    """Each rank's w13 [E, 2I/tp, H] is [its gate rows | its up rows] of every expert, and its
    w2 [E, H, I/tp] the same columns, whether loaded per expert or from the fused tensors."""
    E, H, inter = 3, 5, 8
    gen = torch.Generator().manual_seed(0)
    gate = torch.randn(E, inter, H, generator=gen)
    up = torch.randn(E, inter, H, generator=gen)
    down = torch.randn(E, H, inter, generator=gen)
    fused13 = torch.cat([gate, up], dim=1)  # the released layout [E, 2I, H], gate rows first
    n = inter // tp
    for rank in range(tp):
        fake_tp(rank, tp)
        per_expert, fused = MoEExperts(E, H, inter), MoEExperts(E, H, inter)
        for e in range(E):
            assert weight_shape(per_expert, "w13", "gate_proj", e) == (inter, H)
            assert weight_shape(per_expert, "w2", None, e) == (H, inter)
            load_weight(per_expert, "w13", gate[e], "gate_proj", e)
            load_weight(per_expert, "w13", up[e], "up_proj", e)
            load_weight(per_expert, "w2", down[e], None, e)
        assert weight_shape(fused, "w13") == (E, 2 * inter, H)
        assert weight_shape(fused, "w2") == (E, H, inter)
        load_weight(fused, "w13", fused13)
        load_weight(fused, "w2", down)
        rows = slice(rank * n, (rank + 1) * n)
        want13 = torch.cat([gate[:, rows], up[:, rows]], dim=1)
        for experts in (per_expert, fused):
            assert torch.equal(experts.w13.data, want13), rank
            assert torch.equal(experts.w2.data, down[:, :, rows]), rank


@pytest.mark.parametrize(
    "field, value", [("moe_intermediate_size", 33), ("shared_expert_intermediate_size", 41)]
)
def test_indivisible_expert_width_fails_at_start_up(tmp_path, field: str, value: int) -> None:
    base = SPECS_BY_NAME["qwen3_5_moe_e10k3_g3"]
    spec = dataclasses.replace(base, name="odd", config={**base.config, field: value})
    model_dir, _ = build_model(spec, tmp_path / "m", load_oracle=False)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=re.escape(f"{field} ({value})")) as excinfo:
        _make_llm(model_dir, 2)
    assert "tensor_parallel_size=2" in str(excinfo.value)
    assert set(multiprocessing.active_children()) == before
    assert tp_size() == 1


def test_expert_layer_names_an_indivisible_width(fake_tp) -> None:
    """The layer checks too (a model built without the config check)."""
    fake_tp(0, 2)
    with pytest.raises(ValueError, match=re.escape("moe_intermediate_size (7)")):
        MoEExperts(4, 8, 7)


def test_one_all_reduce_per_moe_block(fake_tp, monkeypatch) -> None:
    """A MoE block's forward sums the routed and the gated shared partials and all-reduces once
    (the shared expert's down projection leaves its sum to the block)."""
    from types import SimpleNamespace

    from deltaserve.layers import moe as moe_layer
    from deltaserve.layers import parallel_linear
    from deltaserve.layers.moe import SparseMoeBlock
    from deltaserve.ops.fused import TorchFusedOps
    from deltaserve.ops.moe.reference import TorchMoE

    fake_tp(0, 2)
    calls: list[tuple[int, ...]] = []

    def counting_all_reduce(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return x

    monkeypatch.setattr(moe_layer, "all_reduce", counting_all_reduce)
    monkeypatch.setattr(parallel_linear, "all_reduce", counting_all_reduce)
    block = SparseMoeBlock(16, 6, 2, intermediate=8, shared_intermediate=12)
    torch.manual_seed(0)
    for p in block.parameters():
        p.data.normal_(0.0, 0.3)
    ctx = SimpleNamespace(kernels=SimpleNamespace(moe=TorchMoE(), fused=TorchFusedOps()))
    x = torch.randn(5, 16)
    out = block(x, ctx)
    assert out.shape == (5, 16)
    assert calls == [(5, 16)]
    # left to the caller (the decoder's next norm): the same partial sum, no all-reduce
    assert parallel_linear.leave_output_partial(block) and not block.reduce_results
    torch.testing.assert_close(block(x, ctx), out, rtol=0, atol=0)
    assert calls == [(5, 16)]


def test_blocks_leave_their_sums_where_they_can(fake_tp) -> None:
    """leave_output_partial: a block's last row-parallel linear stops summing; a bias after
    the sum, or a block that names no such linear, keeps the block as it was."""
    from torch import nn

    from deltaserve.layers.mlp import GatedMLP
    from deltaserve.layers.parallel_linear import RowParallelLinear, leave_output_partial

    fake_tp(0, 2)
    mlp = GatedMLP(16, 32)
    assert mlp.down_proj.reduce_results
    assert leave_output_partial(mlp) and not mlp.down_proj.reduce_results

    class Biased(nn.Module):
        partial_output = "o_proj"

        def __init__(self) -> None:
            super().__init__()
            self.o_proj = RowParallelLinear(16, 16, bias=True)

    biased = Biased()
    assert not leave_output_partial(biased) and biased.o_proj.reduce_results
    assert not leave_output_partial(nn.Linear(4, 4))  # names no partial output


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_in_proj_rows_per_rank(fake_tp, tp: int) -> None:
    """The MoE block's one projection of x: each rank holds [its shared gate_proj rows | its
    shared up_proj rows | the whole router | the whole shared_expert_gate row], filled from
    the four checkpoint tensors by their checkpoint names; the forward slices them back."""
    from deltaserve.layers.moe import SparseMoeBlock
    from deltaserve.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
    from deltaserve.models.weight_names import WeightNameMap

    E, H, inter, shared = 6, 8, 4, 12
    names = WeightNameMap(rules=Qwen3_5MoeForCausalLM.weight_rules)
    gen = torch.Generator().manual_seed(1)
    ckpt = {
        "mlp.gate.weight": torch.randn(E, H, generator=gen),
        "mlp.shared_expert_gate.weight": torch.randn(1, H, generator=gen),
        "mlp.shared_expert.gate_proj.weight": torch.randn(shared, H, generator=gen),
        "mlp.shared_expert.up_proj.weight": torch.randn(shared, H, generator=gen),
        "mlp.shared_expert.down_proj.weight": torch.randn(H, shared, generator=gen),
    }
    n = shared // tp
    for rank in range(tp):
        fake_tp(rank, tp)
        block = SparseMoeBlock(H, E, 2, intermediate=inter, shared_intermediate=shared)
        for name, tensor in ckpt.items():
            target = names.map(name)
            assert names.checkpoint_name(target) == name  # a missing slot is named as stored
            module_name, attr = target.param.removeprefix("mlp.").rsplit(".", 1)
            module = block.get_submodule(module_name)
            assert weight_shape(module, attr, target.shard) == tuple(tensor.shape), name
            load_weight(module, attr, tensor, target.shard)
        rows = slice(rank * n, (rank + 1) * n)
        want = torch.cat(
            [
                ckpt["mlp.shared_expert.gate_proj.weight"][rows],
                ckpt["mlp.shared_expert.up_proj.weight"][rows],
                ckpt["mlp.gate.weight"],
                ckpt["mlp.shared_expert_gate.weight"],
            ]
        )
        assert torch.equal(block.in_proj.weight.data, want), rank
        assert torch.equal(
            block.shared_down.weight.data, ckpt["mlp.shared_expert.down_proj.weight"][:, rows]
        )


def test_replicated_shards_stay_whole(fake_tp) -> None:
    from deltaserve.layers.parallel_linear import ColumnParallelLinear

    fake_tp(1, 2)
    layer = ColumnParallelLinear(4, {"a": 6, "r": 3}, replicated=("r",))
    assert layer.shard_offsets == {"a": (0, 3), "r": (3, 3)}
    assert ("weight", "r") not in layer.tp_rules and ("weight", "a") in layer.tp_rules
    with pytest.raises(ValueError, match=r"replicated shards \['x'\] are not among"):
        ColumnParallelLinear(4, {"a": 6}, replicated=("x",))
    with pytest.raises(ValueError, match="replicated shard r must be one piece"):
        ColumnParallelLinear(4, {"a": 6, "r": (2, 2)}, replicated=("r",))
